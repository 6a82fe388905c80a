"""Custom loops under dynamic loss scaling: unscaled exactly once, never clipped while scaled, silently.

tf.keras 2 code unscales with `get_unscaled_gradients`, may transform the result
(clip it, `tf.identity` it) and calls `apply_gradients`, which in Keras 3 unscales
again. Each update is compared with the plain SGD update the same gradients give
in float32, computed here in NumPy from the model's own input and weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _collect import collect_everything

import tfmp

X = np.linspace(-1.0, 1.0, 24, dtype="float32").reshape(8, 3)
Y = np.linspace(0.5, 1.5, 8, dtype="float32").reshape(8, 1)
LR = 0.1


def _model_and_optimizer():
    with tfmp.policy_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="out")])
        optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=256.0)  # no overflow: the bias gradient sums 8 samples
    return model, optimizer


def _expected_kernel(model):
    """One SGD step on the mean squared error, in float64 from the float32 master weights."""
    kernel, bias = (w.numpy().astype("float64") for w in model.get_layer("out").weights)
    error = X.astype("float64") @ kernel + bias - Y
    return kernel - LR * (2.0 / len(X)) * X.T.astype("float64") @ error


def _loss(model):
    prediction = tf.cast(model(X, training=True), "float32")
    return tf.reduce_mean(tf.square(prediction - Y))


@pytest.mark.parametrize("traced", [True, False], ids=["tf.function", "eager"])
@pytest.mark.parametrize("transform", ["identity", "clip_after_unscaling", "none"])
def test_tf_keras_2_loop_unscales_once_whatever_it_does_to_the_unscaled_gradients(traced, transform):
    model, optimizer = _model_and_optimizer()
    expected = _expected_kernel(model)

    def step():
        with tf.GradientTape() as tape:
            scaled = optimizer.get_scaled_loss(_loss(model))
        grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        if transform == "identity":
            grads = [tf.identity(g) for g in grads]
        elif transform == "clip_after_unscaling":
            grads, _ = tf.clip_by_global_norm(grads, 100.0)  # far above the norm: changes nothing
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    (tf.function(step) if traced else step)()
    kernel = model.get_layer("out").kernel.numpy()
    # float16 forward and backward pass: within float16's precision of the float32 update
    np.testing.assert_allclose(kernel, expected, rtol=2e-3, atol=2e-3)
    assert optimizer.loss_scale == 256.0 and int(optimizer.overflow_count.numpy()) == 0


@pytest.mark.parametrize("then_unscaled", [False, True], ids=["applied", "unscaled-then-applied"])
def test_clipping_the_scaled_gradients_in_a_traced_loop_is_refused_with_the_fix(then_unscaled):
    model, optimizer = _model_and_optimizer()
    before = [w.numpy() for w in model.weights]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(_loss(model))
        grads, _ = tf.clip_by_global_norm(tape.gradient(scaled, model.trainable_variables), 1.0)
        if then_unscaled:  # clipped at the scaled size, then divided: as small
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply(grads, model.trainable_variables)

    with pytest.raises(ValueError, match=r"Invalid `grads` argument\. .* Received: grads='gradients clipped "
                       r"by the op .*clip_by_global_norm.* while multiplied by the loss scale' .* Clip after "
                       r"unscaling: grads = optimizer.get_unscaled_gradients\(grads\)"):
        step()
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights, strict=True))
    step = optimizer = None  # the traced function and the error's frames hold the optimizer
    collect_everything()


def test_unscaled_for_logging_then_the_scaled_gradients_applied_is_unscaled_once():
    """Keras 3 style with a log line: the tape's gradients go to apply, divided there."""
    model, optimizer = _model_and_optimizer()
    expected = _expected_kernel(model)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(_loss(model))
        grads = tape.gradient(scaled, model.trainable_variables)
        norm = tf.linalg.global_norm(optimizer.get_unscaled_gradients(grads))
        optimizer.apply(grads, model.trainable_variables)
        return norm

    assert float(step()) > 0
    np.testing.assert_allclose(model.get_layer("out").kernel.numpy(), expected, rtol=2e-3, atol=2e-3)
