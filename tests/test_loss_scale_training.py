"""tfmp.LossScaleOptimizer in training: custom loops, accumulation, clipping, checkpoints.

Each case compares against the float32 update computed without loss scaling; float32
compute is exact up to rounding (rtol 1e-6), float16 compute gets rtol 1e-3.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.loss_scale import optimizer as _loss_scale

# These tests hand `apply` gradients they scaled themselves, without `scale_loss`.
pytestmark = pytest.mark.filterwarnings("ignore::tfmp.LossScaleWarning")

TOLERANCE = {"float32": 1e-6, "mixed_float16": 1e-3}
X = np.array([[1.0, 2.0, 0.5], [0.25, -1.0, 2.0]], "float32")
Y = np.array([[1.0, 0.0], [0.0, 1.0]], "float32")
KERNEL = np.array([[0.5, -0.25], [0.125, 1.0], [-0.5, 0.75]], "float32")


def _dense(policy):
    layer = keras.layers.Dense(
        2, dtype=policy, kernel_initializer=keras.initializers.Constant(KERNEL)
    )
    layer.build((None, 3))
    return layer


def _loss(layer):
    return tf.reduce_mean(tf.square(tf.cast(layer(X), tf.float32) - Y))


def _reference_kernel():
    layer = _dense("float32")
    with tf.GradientTape() as tape:
        loss = _loss(layer)
    optimizer = keras.optimizers.SGD(0.25)
    optimizer.apply(
        tape.gradient(loss, layer.trainable_variables), layer.trainable_variables
    )
    return layer.kernel.numpy()


def _scaled_gradients_step(layer, optimizer):
    with tf.GradientTape() as tape:
        loss = _loss(layer)
    grads = tfmp.scaled_gradients(tape, loss, layer.trainable_variables, optimizer)
    optimizer.apply(grads, layer.trainable_variables)


def _tf_keras_2_step(layer, optimizer):
    with tf.GradientTape() as tape:
        scaled_loss = optimizer.get_scaled_loss(_loss(layer))
    grads = optimizer.get_unscaled_gradients(
        tape.gradient(scaled_loss, layer.trainable_variables)
    )
    optimizer.apply_gradients(zip(grads, layer.trainable_variables))


# Item 6: custom training loops ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize("step", [_scaled_gradients_step, _tf_keras_2_step])
@pytest.mark.parametrize("compiled", [False, True])
def test_custom_loop_update_equals_float32_reference(policy, step, compiled):
    layer = _dense(policy)
    # 2**10 keeps the float16 backward pass below 65504; 2**15 would overflow here.
    optimizer = tfmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.25), initial_scale=2.0**10
    )
    optimizer.build(layer.trainable_variables)
    (tf.function(step) if compiled else step)(layer, optimizer)
    np.testing.assert_allclose(
        layer.kernel.numpy(), _reference_kernel(), rtol=TOLERANCE[policy]
    )
    assert (
        int(optimizer.overflow_count.numpy()) == 0
        and int(optimizer.total_steps.numpy()) == 1
    )


def test_scaled_gradients_are_scaled_and_record_a_nan_loss():
    layer = _dense("float32")
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.25), initial_scale=8.0)
    optimizer.build(layer.trainable_variables)
    with tf.GradientTape() as tape:
        loss = _loss(layer)
    scaled = tfmp.scaled_gradients(tape, loss, layer.trainable_variables, optimizer)
    with tf.GradientTape() as tape:
        loss = _loss(layer)
    plain = tape.gradient(loss, layer.trainable_variables)
    np.testing.assert_allclose(scaled[0].numpy(), 8.0 * plain[0].numpy(), rtol=1e-6)
    with tf.GradientTape() as tape:
        loss = _loss(layer) * float("nan")
    tfmp.scaled_gradients(tape, loss, layer.trainable_variables, optimizer)
    assert int(optimizer.last_loss_status.numpy()) == 1
    with pytest.raises(ValueError, match=r"Received: tape=None.*tf.GradientTape\(\) as tape"):
        tfmp.scaled_gradients(None, loss, layer.trainable_variables, optimizer)


# Item 7: gradient accumulation and clipping ----------------------------------------------


def test_accumulation_moves_every_second_step_and_skips_an_inf_micro_step():
    inner = keras.optimizers.SGD(0.5, gradient_accumulation_steps=2)
    optimizer = tfmp.LossScaleOptimizer(inner, initial_scale=16.0)
    variable = keras.Variable([4.0])
    history = []
    for unscaled in (1.0, 3.0, float("inf"), 1.0, 3.0):
        optimizer.apply([tf.constant([unscaled * optimizer.loss_scale])], [variable])
        history.append(float(variable.numpy()[0]))
    # Each pair moves the weight by 0.5 * mean(1, 3) = 1; the inf micro-step is dropped.
    assert history == [4.0, 3.0, 3.0, 3.0, 2.0]
    assert optimizer.loss_scale == 8.0
    assert int(optimizer.overflow_count.numpy()) == 1
    assert int(inner._iterations.numpy()) == 4


@pytest.mark.parametrize(
    "clip", [{"clipnorm": 1.0}, {"global_clipnorm": 1.0}, {"clipvalue": 0.5}]
)
def test_clipping_acts_on_unscaled_gradients(clip):
    grad = tf.constant([3.0, 4.0])
    reference = keras.Variable([0.0, 0.0])
    keras.optimizers.SGD(1.0, **clip).apply([grad], [reference])
    variable = keras.Variable([0.0, 0.0])
    optimizer = tfmp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0, **clip), initial_scale=2.0**15
    )
    optimizer.apply([grad * 2.0**15], [variable])
    np.testing.assert_allclose(variable.numpy(), reference.numpy(), rtol=1e-6)
    assert np.abs(variable.numpy()).max() < 1.0  # clipped, not the raw [-3, -4]


# Item 8: an inner loss_scale_factor -----------------------------------------------------


def _fit_kernel(optimizer):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones")]
    )
    model.compile(optimizer, "mse")
    model.fit(X, Y, batch_size=1, shuffle=False, verbose=0)
    return model.get_weights()[0]


def test_inner_loss_scale_factor_update_equals_float32_reference():
    reference = _fit_kernel(keras.optimizers.SGD(0.125))
    inner = keras.optimizers.SGD(0.125, loss_scale_factor=128.0)
    wrapped = _loss_scale.wrap_optimizer(inner, "float16")
    assert inner.loss_scale_factor is None  # Keras disables it so nothing scales twice
    np.testing.assert_allclose(_fit_kernel(wrapped), reference, rtol=1e-6)


# Item 9: checkpoints ---------------------------------------------------------------------


STATE = _loss_scale.STATE_VARIABLES


def _state(optimizer):
    return {name: getattr(optimizer, name).numpy().item() for name in STATE}


def test_model_checkpoint_keras_file_restores_class_scale_and_counters(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(
        tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), 2.0**10, 3, hysteresis=1),
        "mse",
    )
    x = np.ones((8, 2), "float32")
    x[2, 0] = np.nan  # second batch of 2
    path = str(tmp_path / "model.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(path)
    model.fit(
        x,
        np.zeros((8, 1)),
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[checkpoint],
    )
    expected = {
        "dynamic_scale": 512.0,
        "step_counter": 2,
        "overflow_count": 1,
        "consecutive_overflows": 0,
    }
    expected.update(last_overflow_step=1, total_steps=4, min_scale_overflows=0)
    expected.update(last_loss_status=0)  # the last loss was finite
    expected.update(last_overflow_status=1 + 4)  # the skipped step: NaN loss, NaN batch
    assert _state(model.optimizer) == expected
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is tfmp.LossScaleOptimizer
    assert _state(loaded.optimizer) == expected
    assert loaded.optimizer.get_config() == model.optimizer.get_config()


def _apply_run(model, optimizer, unscaled_grads):
    scales = []
    for value in unscaled_grads:
        grads = [
            tf.fill(v.shape, value * optimizer.loss_scale)
            for v in model.trainable_variables
        ]
        optimizer.apply(grads, model.trainable_variables)
        scales.append(optimizer.loss_scale)
    return scales


def _fresh():
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")]
    )
    optimizer = tfmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.125), initial_scale=64.0, dynamic_growth_steps=2
    )
    optimizer.build(model.trainable_variables)
    return model, optimizer


def test_tf_train_checkpoint_resume_continues_the_same_scale_sequence(tmp_path):
    inf = float("inf")
    first, second = [1.0, inf, 1.0, 1.0, inf], [inf, 1.0, 1.0, 1.0, 1.0]
    model, optimizer = _fresh()
    _apply_run(model, optimizer, first)
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        str(tmp_path / "ckpt")
    )
    uninterrupted = _apply_run(model, optimizer, second)
    resumed_model, resumed = _fresh()
    tf.train.Checkpoint(model=resumed_model, optimizer=resumed).restore(
        path
    ).assert_consumed()
    assert (
        _apply_run(resumed_model, resumed, second)
        == uninterrupted
        == [16.0, 16.0, 32.0, 32.0, 64.0]
    )
    assert _state(resumed) == _state(optimizer)
    np.testing.assert_array_equal(
        resumed_model.get_weights()[0], model.get_weights()[0]
    )
