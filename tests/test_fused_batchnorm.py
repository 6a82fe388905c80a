"""Tests for tfmp/_src/float32/fused_batchnorm.py: BatchNormalization on the fused kernel under mixed policies."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from _collect import collect_everything

import tfmp
from tfmp._src.float32 import fused_batchnorm
from tfmp._src.keras_hooks import patches

CASES = [((8, 6, 5, 4), -1), ((4, 3, 4, 5, 6), -1), ((8, 4, 6, 5), 1)]
# 16-bit tolerance: a few units of the last place at |y| <= ~4 (bfloat16 has 8 bits).
pytestmark = pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")  # 16 bits emulated on CPUs
TOLERANCE = {"mixed_bfloat16": 3e-2, "mixed_float16": 4e-3}


@pytest.fixture
def disabled():
    yield
    tfmp.disable()


def _uses_fused_kernel(layer, x, training):
    graph = tf.function(lambda v: layer(v, training=training)).get_concrete_function(x).graph
    return any(op.type == "FusedBatchNormV3" for op in graph.get_operations())


def _run(policy, shape, axis, training, fused, steps=3):
    """`steps` forward/backward calls of one BatchNormalization; returns what they produced."""
    if fused:
        tfmp.enable(policy)
    else:
        keras.config.set_dtype_policy(policy)
    try:
        layer = keras.layers.BatchNormalization(axis=axis, momentum=0.9)
        layer.build(shape)
        channels = shape[axis]
        layer.gamma.assign(np.linspace(0.5, 1.5, channels))
        layer.beta.assign(np.linspace(-1.0, 1.0, channels))
        x = tf.cast(np.random.RandomState(0).normal(2.0, 3.0, shape), layer.compute_dtype)
        weights = tf.cast(np.arange(np.prod(shape)).reshape(shape) % 7, "float32")
        for _ in range(steps):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=training)
                loss = tf.reduce_sum(tf.cast(y, "float32") * weights)
            grads = tape.gradient(loss, [x, layer.gamma, layer.beta])
        used = _uses_fused_kernel(layer, x, training)
        return y, grads, layer.moving_mean.numpy(), layer.moving_variance.numpy(), used, layer
    finally:
        tfmp.disable()
        keras.config.set_dtype_policy("float32")


def _f32(value):
    return tf.cast(value, "float32").numpy()


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("shape,axis", CASES)
@pytest.mark.parametrize("training", [True, False])
def test_fused_matches_keras(policy, shape, axis, training):
    y, grads, mean, variance, used, layer = _run(policy, shape, axis, training, fused=True)
    k_y, k_grads, k_mean, k_variance, k_used, _ = _run(policy, shape, axis, training, fused=False)
    assert (used, k_used) == (True, False)
    assert y.dtype == k_y.dtype == policy[6:]
    np.testing.assert_allclose(_f32(y), _f32(k_y), atol=TOLERANCE[policy])
    # Moving statistics after 3 steps: Keras's update, float32 arithmetic on both sides.
    np.testing.assert_allclose(mean, k_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(variance, k_variance, rtol=1e-5)
    if training:
        assert not np.allclose(variance, 1.0)  # the moving variance did move
    for grad, k_grad in zip(grads, k_grads):
        scale = np.abs(_f32(k_grad)).max() + 1e-6
        np.testing.assert_allclose(_f32(grad) / scale, _f32(k_grad) / scale, atol=TOLERANCE[policy])
    assert grads[0].dtype == policy[6:] and grads[1].dtype == "float32"


def test_center_and_scale_off_and_frozen_layer_use_fused_kernel(disabled):
    tfmp.enable("mixed_bfloat16")
    x = tf.cast(np.random.RandomState(1).normal(1.0, 2.0, (4, 3, 3, 2)), "bfloat16")
    plain = keras.layers.BatchNormalization(center=False, scale=False, epsilon=0.0)
    y = plain(x, training=True)
    mean = tf.reduce_mean(tf.cast(x, "float32"), axis=(0, 1, 2))
    std = tf.math.reduce_std(tf.cast(x, "float32"), axis=(0, 1, 2))
    np.testing.assert_allclose(_f32(y), _f32((tf.cast(x, "float32") - mean) / std), atol=0.04)
    frozen = keras.layers.BatchNormalization()
    frozen.build(x.shape)
    frozen.trainable = False
    frozen(x, training=True)  # Keras: a frozen layer runs in inference mode, no update
    np.testing.assert_array_equal(frozen.moving_mean.numpy(), np.zeros(2, "float32"))
    assert fused_batchnorm.audit_note(plain) == fused_batchnorm.audit_note(frozen) == "fused"


HAS_RENORM = "renorm" in inspect.signature(keras.layers.BatchNormalization.__init__).parameters


@pytest.mark.parametrize("make,shape,why", [
    (lambda: keras.layers.BatchNormalization(), (4, 6, 5), "input rank 3 (the fused kernel takes 4 or 5)"),
    (lambda: keras.layers.BatchNormalization(axis=2), (4, 6, 5, 3),
     "axis 2 of a 4D input (the fused kernel takes the last axis or axis 1)"),
    (lambda: keras.layers.BatchNormalization(synchronized=True), (4, 6, 5, 3), "synchronized=True"),
    pytest.param(lambda: keras.layers.BatchNormalization(renorm=True), (4, 6, 5, 3), "renorm=True",
                 marks=pytest.mark.skipif(not HAS_RENORM, reason="this Keras has no renorm")),
])
def test_cases_not_fused_take_keras_path_and_audit_says_why(disabled, make, shape, why):
    tfmp.enable("mixed_bfloat16")
    model = keras.Sequential([keras.Input(shape[1:]), make()])
    x = tf.ones(shape, "bfloat16")
    layer = model.layers[0]
    assert not _uses_fused_kernel(layer, x, True)
    row = tfmp.audit(model, tensor_cores=False).rows[0]
    assert row.batchnorm_kernel == f"keras: {why}"
    text = str(tfmp.audit(model, tensor_cores=False))
    assert "BatchNormalization on the fused kernel: 0 of 1" in text and f"  {row.path}: keras: {why}" in text


def test_mask_takes_keras_path_and_audit_shows_the_last_call(disabled):
    tfmp.enable("mixed_float16")
    layer = keras.layers.BatchNormalization()
    x = tf.ones((2, 3, 4, 5), "float16")
    mask = tf.ones((2, 3, 4), "bool")
    graph = tf.function(lambda v, m: layer(v, training=True, mask=m)).get_concrete_function(x, mask).graph
    assert "FusedBatchNormV3" not in {op.type for op in graph.get_operations()}
    assert fused_batchnorm.audit_note(layer) == "keras: called with a mask"
    layer(x, training=True)
    assert fused_batchnorm.audit_note(layer) == "fused"


def test_float32_policy_takes_keras_path_and_the_hook_goes_with_the_last_attached_layer(disabled):
    original = vars(keras.layers.BatchNormalization)["call"]
    unattached = keras.layers.BatchNormalization()
    tfmp.enable("float32")
    layer = keras.layers.BatchNormalization()
    x = tf.ones((2, 3, 4, 5))
    assert not _uses_fused_kernel(layer, x, True)
    assert fused_batchnorm.audit_note(layer) == "keras: policy float32 (the fused path is for mixed policies)"
    tfmp.enable("mixed_bfloat16")
    assert len(patches.installed(keras.layers.BatchNormalization, "call")) == 1
    tfmp.disable()
    assert fused_batchnorm.audit_note(unattached) == f"keras: {fused_batchnorm.NOT_ATTACHED}"
    assert len(patches.installed(keras.layers.BatchNormalization, "call")) == 1  # `layer` is attached
    del layer
    collect_everything()
    tfmp.disable()  # not enabled: takes off the hooks no live attached layer needs
    assert patches.installed(keras.layers.BatchNormalization, "call") == []
    assert vars(keras.layers.BatchNormalization)["call"] is original


def test_audit_counts_fused_layers(disabled):
    tfmp.enable("mixed_bfloat16")
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Reshape((36, 8))(x)
    x = keras.layers.BatchNormalization(name="bn_seq")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(keras.layers.Flatten()(x)))
    report = tfmp.audit(model, tensor_cores=False)
    notes = {r.path: r.batchnorm_kernel for r in report.rows}
    assert notes == {"conv": "", "bn": "fused", "reshape": "", "bn_seq":
                     "keras: input rank 3 (the fused kernel takes 4 or 5)", "flatten": "", "out": ""}
    assert "BatchNormalization on the fused kernel: 1 of 2" in str(report)


def test_fit_saves_plain_keras_layer_that_loads_without_tfmp(disabled, tmp_path):
    tfmp.enable("mixed_bfloat16")
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(keras.layers.Flatten()(x)))
    model.compile(optimizer="sgd", loss="mse")
    data = np.random.RandomState(2).normal(size=(16, 6, 6, 2)).astype("float32")
    model.fit(data, np.ones((16, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    bn = model.get_layer("bn")
    assert not np.allclose(bn.moving_mean.numpy(), 0.0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    tfmp.disable()
    loaded = keras.models.load_model(path, compile=False)
    assert tfmp.attachment(loaded) is None
    assert type(loaded.get_layer("bn")) is keras.layers.BatchNormalization
    np.testing.assert_array_equal(loaded.get_layer("bn").moving_variance.numpy(), bn.moving_variance.numpy())
    assert not _uses_fused_kernel(loaded.get_layer("bn"), tf.ones((2, 4, 4, 4), "bfloat16"), False)
