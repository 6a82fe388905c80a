"""Tests for tfmp.estimate_memory and tfmp.estimate_kv_cache."""

import json
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.advisors import memory as _memory


def _model():
    """Dense + BatchNorm + Dropout: trainable, non-trainable and int64 seed variables."""
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(10),
        keras.layers.Activation("softmax", dtype="float32"),
    ])


def _nbytes(variables):
    return sum(np.asarray(v.numpy()).nbytes for v in variables)


def test_parameter_gradient_and_adam_bytes_equal_the_real_variables():
    model = _model()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    x = np.random.default_rng(0).normal(size=(8, 64)).astype("float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)

    est = tfmp.estimate_memory(model, batch_size=8, optimizer=optimizer)

    assert est.parameter_bytes == _nbytes(model.variables)
    assert est.gradient_bytes == sum(g.numpy().nbytes for g in grads)
    assert est.optimizer_bytes == _nbytes(optimizer.variables)
    # Adam: momentum + velocity per trainable parameter, plus iteration (int64)
    # and learning rate (float32) scalars.
    assert est.optimizer_bytes - est.optimizer_scalar_bytes == 2 * est.gradient_bytes
    assert est.optimizer_scalar_bytes == 8 + 4


def test_compiled_mixed_float16_model_counts_loss_scale_variables():
    keras.config.set_dtype_policy("mixed_float16")
    model = _model()
    model.compile("adam", "sparse_categorical_crossentropy")
    x = np.zeros((4, 64), "float32")
    model.train_on_batch(x, np.zeros((4,), "int32"))  # builds the optimizer
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)

    est = tfmp.estimate_memory(model, batch_size=4)

    assert est.optimizer_bytes == _nbytes(model.optimizer.variables)
    assert est.parameter_bytes == _nbytes(model.variables)
    assert est.parameter_bytes == est.float32_parameter_bytes  # float32 master weights


def test_unbuilt_optimizer_is_counted_on_a_copy_and_left_unbuilt():
    model = _model()
    optimizer = keras.optimizers.SGD(momentum=0.9)
    est = tfmp.estimate_memory(model, batch_size=1, optimizer=optimizer)
    assert not optimizer.built
    assert est.optimizer_bytes - est.optimizer_scalar_bytes == est.gradient_bytes


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_activation_bytes_halve_under_a_mixed_policy(policy):
    model = _model()
    est = tfmp.estimate_memory(model, batch_size=32, policy=policy, optimizer="adam")
    f32 = tfmp.estimate_memory(model, batch_size=32, policy="float32", optimizer="adam")
    # Outputs of Dense(32), BatchNorm(32), Dropout(32), Dense(10), softmax(10).
    elements = 32 * (32 + 32 + 32 + 10 + 10)
    assert f32.activation_bytes == est.float32_activation_bytes == 4 * elements
    assert est.activation_bytes * 2 == est.float32_activation_bytes
    assert est.saving_bytes == est.float32_activation_bytes - est.activation_bytes
    assert est.parameter_bytes == f32.parameter_bytes


def test_policy_none_uses_each_layers_real_output_dtype():
    keras.config.set_dtype_policy("mixed_bfloat16")
    est = tfmp.estimate_memory(_model(), batch_size=32)
    # Four bfloat16 outputs (32, 32, 32, 10) and the float32 softmax (10).
    assert est.activation_bytes == 32 * (2 * (32 + 32 + 32 + 10) + 4 * 10)
    assert est.policy == "as built (mixed_bfloat16)"
    assert est.optimizer_bytes == 0 and est.notes


def test_nested_models_are_counted_through_their_layers():
    inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    outer = keras.Sequential([keras.Input((8,)), inner, keras.layers.Dense(2)])
    est = tfmp.estimate_memory(outer, batch_size=2, policy="float32")
    assert est.activation_bytes == 2 * (4 + 2) * 4


def test_report_renders_and_serializes():
    est = tfmp.estimate_memory(_model(), 16, policy="mixed_bfloat16", optimizer="adam")
    text = str(est)
    assert "activations" in text and "float32" in text and "saving" in text
    guide = pathlib.Path(__file__).resolve().parents[1] / "tfmp" / "docs" / "troubleshooting.md"
    [saving] = [line for line in text.splitlines() if line.startswith("saving: ")]
    assert saving.endswith(f"; activations are an estimate, see {guide}#no-memory-saving")
    data = json.loads(json.dumps(est.to_dict()))
    assert data["total_bytes"] == est.total_bytes
    assert data["saving_bytes"] == est.float32_total_bytes - est.total_bytes


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(batch_size=0), "batch_size=0"),
        (dict(batch_size=8, policy="fp16"), "policy='fp16'"),
        (dict(batch_size=8, optimizer=3), "optimizer=3"),
    ],
)
def test_bad_arguments_use_the_error_template(kwargs, fragment):
    with pytest.raises(ValueError, match="Received: " + fragment):
        tfmp.estimate_memory(_model(), **kwargs)


def test_unbuilt_model_is_rejected():
    with pytest.raises(ValueError, match="Expected a built keras.Model"):
        tfmp.estimate_memory(keras.Sequential([keras.layers.Dense(2)]), 4)


@pytest.mark.parametrize(
    "dtype, per_element", [("float32", 4), ("float16", 2), ("bfloat16", 2),
                           ("mixed_bfloat16", 2), ("int8", 1)])
def test_kv_cache_is_two_vectors_per_layer_per_token(dtype, per_element):
    got = tfmp.estimate_kv_cache(32, 4096, seq_len=2048, batch_size=4, dtype=dtype)
    assert got == 2 * 32 * 4096 * per_element * 2048 * 4


def test_kv_cache_rejects_bad_sizes_and_dtypes():
    with pytest.raises(ValueError, match="Received: seq_len=0"):
        tfmp.estimate_kv_cache(2, 8, seq_len=0, batch_size=1)
    with pytest.raises(ValueError, match="Received: dtype='fp8'"):
        tfmp.estimate_kv_cache(2, 8, seq_len=1, batch_size=1, dtype="fp8")


def test_format_bytes_uses_binary_units():
    got = [_memory.format_bytes(n) for n in (5, 1536, 3 * 2**30, -2048)]
    assert got == ["5 B", "1.50 KiB", "3.00 GiB", "-2.00 KiB"]
