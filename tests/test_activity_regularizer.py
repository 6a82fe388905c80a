"""A 16-bit layer's activity regularizer computes on its output cast to float32, and is saved as Keras's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp

X = np.full((4, 3), 40.0, "float32")  # activations of about 100: 0.01 * sum(x**2) ~ 1e5 > 65504


def _model():
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(8, kernel_initializer="ones", name="wide",
                                                 activity_regularizer=keras.regularizers.L2(0.01)),
                              keras.layers.Dense(1, name="out")])
    return model


def test_plain_keras_float16_regularizer_overflows_so_tfmp_computes_it_in_float32():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        plain = _model()
        plain(X)
        assert not np.isfinite(float(plain.losses[0]))  # plain Keras: inf (fails when Keras fixes it)
    finally:
        keras.config.set_dtype_policy("float32")
    with tfmp.policy_scope("mixed_float16"):
        model = _model()
        model.compile("sgd", "mse")
    assert tfmp.attachment(model).activity_regularizers_in_float32 == ["wide"]
    wide = model.get_layer("wide")
    outputs = wide(tf.constant(X))  # float16, about 120 each
    (term,) = [loss for loss in wide.losses]
    squares = np.sum(np.square(outputs.numpy().astype("float64")))
    assert outputs.dtype == "float16" and squares > 65504  # overflows when summed in float16
    reference = _model().get_layer("wide")  # float32: the same term, as Keras normalizes it
    reference(tf.constant(X))
    # Every activation is exactly 3 * 40 = 120 in float16 and float32, so the terms are equal.
    assert term.dtype == "float32" and float(term) == float(reference.losses[0])
    assert float(term) in (pytest.approx(0.01 * squares), pytest.approx(0.01 * squares / len(X)))


def test_the_regularizer_is_saved_as_keras_and_detach_gives_its_class_back():
    with tfmp.policy_scope("mixed_bfloat16"):
        model = _model()
        model.compile("sgd", "mse")
    wide = model.get_layer("wide")
    assert type(wide.activity_regularizer).__name__ == "Float32Regularizer"
    reference = keras.layers.Dense(8, kernel_initializer="ones", name="wide",
                                   activity_regularizer=keras.regularizers.L2(0.01), dtype="mixed_bfloat16")
    reference.build((None, 3))
    assert wide.get_config() == reference.get_config()  # saved as the user's L2
    assert type(wide.activity_regularizer) is not keras.regularizers.L2  # and still float32 after saving
    tfmp.detach(model)
    assert type(wide.activity_regularizer) is keras.regularizers.L2
    assert wide.get_config() == reference.get_config()


def test_a_float16_fit_with_the_regularizer_reports_finite_losses():
    with tfmp.policy_scope("mixed_float16"):
        model = _model()
        model.compile("sgd", "mse")
        history = model.fit(np.tile(X, (4, 1)), np.ones((16, 1), "float32"), batch_size=4, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()  # plain Keras: the term is inf (first test)
