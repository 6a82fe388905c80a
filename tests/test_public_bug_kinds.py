"""Public mixed-precision bug reports against Keras and TensorFlow, reduced to small inputs.

One test per kind, each citing its report: plain Keras mixed precision gets the
value wrong (shown first, so the case stays a real one), tfmp gets float32's
value (within the 16-bit tolerance of the layers that still compute in 16 bits).
"""

import keras
import numpy as np
import pytest

import tfmp


def _attention_model():
    query, value = keras.Input((4, 8)), keras.Input((5, 8))
    mask = [None, keras.ops.convert_to_tensor(np.array([[True] * 3 + [False] * 2] * 2))]
    attended = keras.layers.Attention()([query, value], mask=mask)
    return keras.Model([query, value], keras.layers.Dense(3)(attended))


def _predict_under(policy, build, weights, x, *, with_tfmp):
    """`build()`'s prediction under `policy`, with `weights`, plain Keras or tfmp."""
    if with_tfmp:
        with tfmp.policy_scope(policy):
            model = build()
            model.compile("sgd", "mse")
    else:
        keras.config.set_dtype_policy(policy)  # restored by conftest's restore_global_policy
        model = build()
        keras.config.set_dtype_policy("float32")
        model.compile("sgd", "mse")
    model.set_weights(weights)
    return model.predict(x, verbose=0), model


def test_attention_scores_near_1e5_keep_float32_values_tensorflow_46064():
    """tensorflow#46064: `keras.layers.Attention` with a mask and unscaled dot-product
    scores around 1e5 (inputs of scale 300 over 8 features) under mixed_float16:
    the scores overflow float16 (65504) before the softmax and `predict` returns NaN."""
    rng = np.random.default_rng(0)
    x = [(300 * rng.normal(size=(2, 4, 8))).astype("float32"),
         (300 * rng.normal(size=(2, 5, 8))).astype("float32")]
    keras.utils.set_random_seed(0)
    reference = _attention_model()
    weights = reference.get_weights()
    expected = reference.predict(x, verbose=0)
    plain, _ = _predict_under("mixed_float16", _attention_model, weights, x, with_tfmp=False)
    assert np.isnan(plain).any()  # the report's failure in plain Keras (Keras 3.16 keeps a few rows finite)
    got, model = _predict_under("mixed_float16", _attention_model, weights, x, with_tfmp=True)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    # The attention's inputs arrive in float16 (relative step 2**-10), so its output
    # carries that rounding: 2**-8 of the output's scale bounds it.
    np.testing.assert_allclose(got, expected, rtol=0, atol=2**-8 * np.abs(expected).max())
    [row] = [r for r in tfmp.audit(model).rows if r.class_name == "Attention"]
    assert (row.compute_dtype, row.why) == ("float32", "softmax inside")


# Where tfmp already leads: plain Keras gets these wrong under a mixed policy because
# the model's outputs stay 16-bit; tfmp's outputs are float32. Weights are set by
# hand (no training), so each value is the same on every CPU.


def _confident_classifier():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile("sgd", "binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision")])
    return model


def _confident_weights():
    """Logit 6 + 12 * relu(x0) - 12 * relu(-x0): sigmoid outputs above 0.9975 for every
    x0 > 0, which bfloat16 (8 significant bits) rounds to exactly 1.0."""
    w = [np.zeros((4, 8), "float32"), np.zeros(8, "float32"),
         np.zeros((8, 1), "float32"), np.array([6.0], "float32")]
    w[0][0, 0], w[0][0, 1], w[2][0, 0], w[2][1, 0] = 1.0, -1.0, 12.0, -12.0
    return w


def test_classification_loss_and_metrics_under_bfloat16_match_float32():
    """Metrics and loss of a confident classifier under mixed_bfloat16 (the kind of
    report behind "AUC under bfloat16"): plain Keras's bfloat16 sigmoid rounds
    outputs above 0.998 to 1.0, and binary cross-entropy of a wrong 1.0 is clipped
    at -log(1e-7), so the loss grows by more than a third; tfmp's float32 output keeps
    float32's loss, AUC and precision."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4)).astype("float32")
    y = (x[:, 0] + 0.5 * rng.normal(size=2000) > 0).astype("float32")
    reference = _confident_classifier()
    reference.set_weights(_confident_weights())
    expected = reference.evaluate(x, y, verbose=0, return_dict=True)
    keras.config.set_dtype_policy("mixed_bfloat16")  # restored by conftest
    plain = _confident_classifier()
    keras.config.set_dtype_policy("float32")
    plain.set_weights(_confident_weights())
    assert plain.evaluate(x, y, verbose=0, return_dict=True)["loss"] > 1.3 * expected["loss"]
    with tfmp.policy_scope("mixed_bfloat16"):
        model = _confident_classifier()
    model.set_weights(_confident_weights())
    got = model.evaluate(x, y, verbose=0, return_dict=True)
    for name in ("loss", "auc", "precision"):
        assert abs(got[name] - expected[name]) <= 1e-3 * abs(expected[name]), name


def _regression_model():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(4)(inputs)))
    model.compile(keras.optimizers.SGD(learning_rate=0.0), "mse")  # no update: values compared as they are
    return model


def _regression_weights():
    """Output = 3000 + x0 + x1 exactly (identity hidden layer)."""
    hidden = np.zeros((2, 4), "float32")
    hidden[0, 0] = hidden[1, 1] = 1.0
    output = np.zeros((4, 1), "float32")
    output[0, 0] = output[1, 0] = 1.0
    return [hidden, np.zeros(4, "float32"), output, np.array([3000.0], "float32")]


def test_regression_targets_near_3000_from_float64_arrays_and_float16_tf_data_match_float32():
    """Targets near 3,000 (float64 arrays with `validation_split` and `sample_weight`,
    and float16 targets from `tf.data`) under mixed_float16: plain Keras's float16
    output has a spacing of 2 there, so predictions are off by up to 1 and the mean
    squared error grows tenfold; tfmp's float32 output gives float32's loss."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.uniform(-0.45, 0.45, size=(256, 2))  # float64, as data often arrives
    y = 3000.0 + x.sum(axis=1) + rng.normal(scale=0.05, size=256)
    weight = rng.uniform(0.5, 1.5, size=256)
    data16 = tf.data.Dataset.from_tensor_slices((x, y.astype("float16"), weight)).batch(64)

    def losses(model):
        model.set_weights(_regression_weights())
        history = model.fit(x, y, sample_weight=weight, validation_split=0.25, epochs=1,
                            batch_size=64, verbose=0).history
        return history["val_loss"][0], model.evaluate(data16, verbose=0)

    expected_val, expected_16 = losses(_regression_model())
    assert expected_val < 0.01  # the noise (0.05**2), plus float32 rounding at 3000
    keras.config.set_dtype_policy("mixed_float16")  # restored by conftest
    plain = _regression_model()
    keras.config.set_dtype_policy("float32")
    plain_val, _ = losses(plain)
    assert plain_val > 10 * expected_val
    with tfmp.policy_scope("mixed_float16"):
        model = _regression_model()
    got_val, got_16 = losses(model)
    assert got_val == pytest.approx(expected_val, rel=0.01)
    assert got_16 == pytest.approx(expected_16, rel=0.01)


def test_top_5_accuracy_of_a_16_bit_classifier_trains_as_in_keras_io_vit():
    """The keras.io ViT's `SparseTopKCategoricalAccuracy(5)` metric under
    mixed_bfloat16: plain Keras fails in `fit` because TensorFlow's InTopKV2 takes
    float32 predictions only; with tfmp the logits are float32 and the metric is
    float32's."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), np.arange(64) % 10

    def build():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[keras.metrics.SparseTopKCategoricalAccuracy(5, name="top-5-accuracy")])
        return model

    keras.utils.set_random_seed(0)
    reference = build()
    weights = reference.get_weights()
    expected = reference.evaluate(x, y, verbose=0, return_dict=True)["top-5-accuracy"]
    keras.config.set_dtype_policy("mixed_bfloat16")  # restored by conftest
    plain = build()
    keras.config.set_dtype_policy("float32")
    with pytest.raises(TypeError, match="'InTopKV2' Op has type bfloat16"):
        plain.fit(x, y, epochs=1, verbose=0)
    with tfmp.policy_scope("mixed_bfloat16"):
        model = build()
    model.set_weights(weights)
    assert model.evaluate(x, y, verbose=0, return_dict=True)["top-5-accuracy"] == pytest.approx(expected, abs=1 / 64)
    assert np.isfinite(model.fit(x, y, epochs=1, verbose=0).history["loss"][0])
