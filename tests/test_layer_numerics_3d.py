"""float16 3-D pooling on a CPU (no TensorFlow kernel): forced to float32 there, Keras's own on a GPU."""

import json
import warnings

import _subproc
import keras
import numpy as np
import pytest
import tensorflow as tf
from _machines import A100, ZEN4

import tfmp
from tfmp._src.float32 import pooling3d
from tfmp._src.policy.hardware import injected_facts

VOLUMES = np.random.default_rng(0).normal(size=(2, 8, 8, 8, 3)).astype("float32") * 4.0
POOLINGS = {"max": keras.layers.MaxPooling3D, "average": keras.layers.AveragePooling3D}


@pytest.fixture(autouse=True)
def always_disable():
    yield
    tfmp.disable()


def _model(pooling):
    inputs = keras.Input((8, 8, 8, 3))
    pooled = POOLINGS[pooling](2, name="pool")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(keras.layers.Flatten()(pooled)))


def _compiled(pooling, policy="mixed_float16", **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # float16 slower than float32 here
        tfmp.enable(policy, **options)
    model = _model(pooling)
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize("pooling", sorted(POOLINGS))
def test_float16_3d_pooling_on_a_cpu_computes_in_float32_and_hands_float16_on(pooling):
    with pytest.raises(tf.errors.NotFoundError, match="Pool3D"):  # plain Keras: no float16 CPU kernel
        POOLINGS[pooling](2, dtype="mixed_float16")(VOLUMES)
    with injected_facts(ZEN4):
        model = _compiled(pooling)
        report = str(tfmp.audit(model))
    assert tfmp.attachment(model).forced_float32["pool"] == pooling3d.REASON
    assert pooling3d.REASON in report
    pool = model.get_layer("pool")
    assert (pool.compute_dtype, pool.output.dtype) == ("float32", "float16")
    halves = VOLUMES.astype("float16")  # what the layer gets from float16 code
    computed = np.asarray(pool(halves))
    assert computed.dtype == np.float16
    reference = POOLINGS[pooling](2, dtype="float32")(halves.astype("float32"))  # same values, float32
    expected = np.asarray(keras.ops.cast(reference, "float16"))  # rounded once
    np.testing.assert_array_equal(computed, expected)
    if pooling == "max":  # exact: the maximum of float16 values is a float16 value
        np.testing.assert_array_equal(computed.astype("float32"), np.asarray(reference))
    history = model.fit(VOLUMES, np.ones((2, 1), "float32"), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.parametrize("pooling", sorted(POOLINGS))
def test_on_a_gpu_keras_s_float16_pooling_stays(pooling):
    with injected_facts(A100):
        model = _compiled(pooling)
        assert pooling3d.reason(model.get_layer("pool")) is None
    assert model.get_layer("pool").compute_dtype == "float16"
    assert "pool" not in tfmp.attachment(model).forced_float32


def test_bfloat16_3d_pooling_has_cpu_kernels_and_is_left_alone():
    with injected_facts(ZEN4):
        model = _compiled("average", "mixed_bfloat16")
    pool = model.get_layer("pool")
    assert pool.compute_dtype == "bfloat16" and "pool" not in tfmp.attachment(model).forced_float32
    assert pool(VOLUMES).dtype == "bfloat16"  # TensorFlow has the kernel


def test_an_excluded_float16_3d_pooling_on_a_cpu_is_refused_naming_the_layer_and_the_fix():
    with injected_facts(ZEN4), pytest.raises(ValueError) as raised:
        _compiled("max", exclude_float32=["pool"])
    assert str(raised.value).startswith(
        "Invalid `exclude` argument. Expected no float16 MaxPooling3D excluded from float32 on a "
        "machine without GPUs or TPUs")
    assert "Received: exclude='pool'" in str(raised.value)
    assert "Take the target matching 'pool' out of exclude=" in str(raised.value)
    assert 'MaxPooling3D(..., dtype="float32")' in str(raised.value)
    with injected_facts(A100):  # a GPU has the kernel: the exclusion is honoured
        model = _compiled("max", exclude_float32=["pool"])
    assert model.get_layer("pool").compute_dtype == "float16"


def test_a_saved_forced_3d_pooling_opens_and_trains_in_plain_keras(tmp_path):
    with injected_facts(ZEN4):
        model = _compiled("average")
        user_config = json.loads(json.dumps(_model("average").get_layer("pool").get_config()))
        model.fit(VOLUMES, np.ones((2, 1), "float32"), verbose=0)
    model.save(tmp_path / "pool.keras")
    tfmp.disable()

    found = _subproc.plain_keras_load(tmp_path / "pool.keras", tmp_path)

    assert found["tfmp_imported"] is False
    assert found["policies"] == ["float32", "float32", "mixed_float16", "float32"]  # input, pool, flatten, out
    loaded = found["configs"]["pool"]
    assert loaded["dtype"]["config"]["name"] == "float32"
    assert {k: v for k, v in loaded.items() if k != "dtype"} == \
        {k: v for k, v in user_config.items() if k != "dtype"}
    assert np.isfinite(found["loss_after_one_step"])
