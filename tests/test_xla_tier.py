"""The XLA tier's switch (tests/_xla.py): under TFMP_TEST_JIT_COMPILE=1 "auto" compiles with XLA, and only then."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import _xla


def _model(*middle):
    return keras.Sequential([keras.Input((3,)), *middle, keras.layers.Dense(1)])


def _through_python(t):
    out = tf.numpy_function(lambda a: a, [t], tf.float32, stateful=False)
    out.set_shape(t.shape)
    return out + 0.0 * t  # a gradient for the layers before


def _numpy_identity():
    """A layer running a Python function: a graph runs it, XLA cannot compile it."""
    return keras.layers.Lambda(_through_python, output_shape=(3,))


def _cpu_only():
    return not [d for d in tf.config.list_physical_devices() if d.device_type != "CPU"]


@pytest.mark.skipif(not _xla.xla_tier(), reason="the XLA tier's switch: runs with TFMP_TEST_JIT_COMPILE=1")
def test_in_the_tier_auto_compiles_with_xla_and_an_explicit_choice_is_kept():
    auto, default, off, on = (_model() for _ in range(4))
    auto.compile("sgd", "mse", jit_compile="auto")
    default.compile("sgd", "mse")
    off.compile("sgd", "mse", jit_compile=False)
    on.compile("sgd", "mse", jit_compile=True)
    assert (auto.jit_compile, default.jit_compile, off.jit_compile, on.jit_compile) == (True, True, False, True)
    assert _model().jit_compile is True  # never compiled: Keras resolves "auto" too


@pytest.mark.skipif(not _xla.xla_tier(), reason="the XLA tier's switch: runs with TFMP_TEST_JIT_COMPILE=1")
def test_in_the_tier_the_step_really_runs_under_xla():
    """An op XLA cannot compile stops the default-compiled fit; the same model compiled without XLA trains."""
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    plain = _model(_numpy_identity())
    plain.compile("sgd", "mse", jit_compile=False)
    plain.fit(x, y, batch_size=4, verbose=0)
    model = _model(_numpy_identity())
    model.compile("sgd", "mse")
    with pytest.raises(Exception, match="(?s)unsupported operations.*XLA_(CPU|GPU)_JIT"):
        model.fit(x, y, batch_size=4, verbose=0)


@pytest.mark.skipif(not _xla.xla_tier(), reason="the XLA tier's switch: runs with TFMP_TEST_JIT_COMPILE=1")
def test_in_the_tier_a_distributed_model_keeps_auto_off_as_on_a_gpu():
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = _model()
    model.compile("sgd", "mse")
    assert model.jit_compile is False


@pytest.mark.skipif(_xla.xla_tier() or not _cpu_only(),
                    reason="the plain tier on a CPU-only machine: Keras's own 'auto'")
def test_outside_the_tier_auto_is_kerass_own_no_xla_on_a_cpu():
    model = _model()
    model.compile("sgd", "mse")
    assert model.jit_compile is False


def test_the_switch_puts_back_whatever_resolution_it_found():
    base = _xla.base_trainer()
    before = vars(base)["_resolve_auto_jit_compile"]
    with pytest.raises(RuntimeError, match="inside"):
        with _xla.gpu_like_auto_jit_compile():
            assert vars(base)["_resolve_auto_jit_compile"] is _xla._gpu_like_resolution
            raise RuntimeError("inside")
    assert vars(base)["_resolve_auto_jit_compile"] is before


@pytest.mark.parametrize("value", ["true", "yes", " 1"])
def test_a_variable_that_is_neither_0_nor_1_is_refused(monkeypatch, value):
    monkeypatch.setenv(_xla.VARIABLE, value)
    with pytest.raises(ValueError, match="TFMP_TEST_JIT_COMPILE"):
        _xla.xla_tier()
