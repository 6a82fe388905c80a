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


CLIPS = {
    "clip_by_global_norm": lambda grads: tf.clip_by_global_norm(grads, 0.1)[0],
    "clip_by_norm": lambda grads: [tf.clip_by_norm(g, 0.1) for g in grads],
    "clip_by_value": lambda grads: [tf.clip_by_value(g, -0.01, 0.01) for g in grads],
}


def _eager_step(optimizer, model, clip, then_unscaled=False, scaled_gradients=tfmp.scaled_gradients):
    with tf.GradientTape() as tape:
        loss = _loss(model)
    grads = clip(scaled_gradients(tape, loss, model.trainable_variables, optimizer))
    if then_unscaled:
        grads = optimizer.get_unscaled_gradients(grads)
    optimizer.apply(grads, model.trainable_variables)


def _keras_scaled_gradients(tape, loss, variables, optimizer):
    with tape:
        scaled = optimizer.scale_loss(loss)
    return tape.gradient(scaled, variables)


@pytest.mark.parametrize("then_unscaled", [False, True], ids=["applied", "unscaled-then-applied"])
@pytest.mark.parametrize("clip", list(CLIPS))
def test_clipping_the_scaled_gradients_in_an_eager_loop_is_refused_where_keras_updates_about_nothing(
        clip, then_unscaled):
    """Eager, no graph shows the clip: `apply` compares with what `tfmp.scaled_gradients` handed out
    (`guard.cut_while_scaled`). Plain Keras's LossScaleOptimizer divides the gradients clipped at their
    scaled size by 256: its update is ~1/256 of float32's update of the clipped gradients."""
    keras.utils.set_random_seed(0)  # initial weights whose gradients the clips cut
    model, _ = _model_and_optimizer()
    float32_kernel = model.get_layer("out").kernel.numpy()
    float32_update = _clipped_sgd_update(model, CLIPS[clip])
    plain = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=256.0)
    _eager_step(plain, model, CLIPS[clip], scaled_gradients=_keras_scaled_gradients)
    plain_update = np.linalg.norm(model.get_layer("out").kernel.numpy() - float32_kernel)
    assert plain_update < np.linalg.norm(float32_update) / 100  # Keras: silently about nothing

    model, optimizer = _model_and_optimizer()
    before = [w.numpy() for w in model.weights]
    with pytest.raises(ValueError, match=r"Invalid `grads` argument\. .* Received: grads='gradients clipped by "
                       r"(a factor of|a cut at) .* after tfmp.scaled_gradients while multiplied by the loss "
                       r"scale' .* Clip after unscaling: grads = optimizer.get_unscaled_gradients\(grads\)"):
        _eager_step(optimizer, model, CLIPS[clip], then_unscaled)
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights, strict=True))


def _clipped_sgd_update(model, clip):
    """The float32 SGD update (kernel) of the true gradients clipped by `clip`."""
    with tf.GradientTape() as tape:
        kernel, bias = (tf.constant(w.numpy()) for w in model.get_layer("out").weights)
        tape.watch([kernel, bias])
        loss = tf.reduce_mean(tf.square(X @ kernel + bias - Y))
    return -LR * clip(tape.gradient(loss, [kernel, bias]))[0].numpy()


@pytest.mark.parametrize("clip", list(CLIPS))
def test_eager_gradients_unscaled_then_clipped_update_like_float32(clip):
    keras.utils.set_random_seed(0)  # initial weights whose gradients the clips cut
    model, optimizer = _model_and_optimizer()
    kernel = model.get_layer("out").kernel.numpy()
    expected = kernel + _clipped_sgd_update(model, CLIPS[clip])
    unclipped = kernel + _clipped_sgd_update(model, lambda grads: grads)
    assert not np.allclose(expected, unclipped, rtol=0.05)  # the clip changes the update

    with tf.GradientTape() as tape:
        loss = _loss(model)
    grads = optimizer.get_unscaled_gradients(tfmp.scaled_gradients(tape, loss, model.trainable_variables, optimizer))
    optimizer.apply(CLIPS[clip](grads), model.trainable_variables)
    np.testing.assert_allclose(model.get_layer("out").kernel.numpy(), expected, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("copy", [tf.identity, lambda g: tf.cast(tf.cast(g, "bfloat16"), g.dtype)],
                         ids=["identity", "bfloat16-round-trip"])
def test_eager_scaled_gradients_copied_or_clipped_above_their_norm_are_applied_unscaled_once(copy):
    """What leaves the scaled gradients as they are (to a cast's rounding, the bias's one value among them)
    is no clip: no refusal, the float32 update."""
    model, optimizer = _model_and_optimizer()
    expected = _expected_kernel(model)
    _eager_step(optimizer, model, lambda grads: tf.clip_by_global_norm([copy(g) for g in grads], 1e9)[0])
    np.testing.assert_allclose(model.get_layer("out").kernel.numpy(), expected, rtol=2e-3, atol=2e-3)


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


def test_a_cast_rounding_one_value_down_is_no_eager_clip_but_a_clip_to_half_is():
    """`guard.cut_while_scaled` on a one-value gradient (a bias): bfloat16 rounds 1001.0 down to 1000.0
    (0.1%), less than `guard.LEAST_CUT`; a clip to 500.0 cuts it by half."""
    from tfmp._src.loss_scale import guard

    given = [tf.constant([1001.0])]
    rounded = [tf.cast(tf.cast(given[0], "bfloat16"), "float32")]
    assert float(rounded[0][0]) == 1000.0
    assert guard.cut_while_scaled(given, rounded) == ""
    assert guard.cut_while_scaled(given, [tf.clip_by_value(given[0], -500.0, 500.0)]).startswith("a factor of 0.5")
