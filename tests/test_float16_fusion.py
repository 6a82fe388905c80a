"""The fused float16 matmul trap: the probe, the per-thread remapper switch, the per-model scope.

What is fused here is read from TensorFlow's RunMetadata (the post-optimization
graph of every function instantiated inside `post_optimization_ops`). On a CPU
whose TensorFlow fuses no float16 matmul (x86 without AVX-512, e.g. Zen 3:
the remapper's CPU fused matmul takes float32, and bfloat16 under oneDNN) the
float16 side is observed through the float32 output layer tfmp forces in a
``mixed_float16`` model: its MatMul and bias add become ``_FusedMatMul`` when
the remapper runs, on any CPU. The trap itself is injected
(`float16_fusion.injected`); no test asserts a time.
"""

import contextlib
import math
import threading
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tfmp
from tfmp import DeviceFacts, GpuFacts
from tfmp._src.keras_hooks import keras_private, patches, step_scope, train_function
from tfmp._src.policy import float16_fusion
from tfmp._src.policy.policy import resolve_policy

pytestmark = pytest.mark.skipif(
    bool(tf.config.list_physical_devices("GPU")),
    reason="the remapper switch applies to steps on the CPU; this machine has a GPU",
)

X, Y = np.ones((8, 8), "float32"), np.ones((8, 2), "float32")  # batch_size=4: 2 steps
CPU = DeviceFacts(cpu_name="Intel Xeon Platinum 8480+", cpu_flags=frozenset({"amx_bf16", "avx512_fp16"}))
T4 = DeviceFacts(gpus=(GpuFacts("Tesla T4", (7, 5)),))
OFF = type(tf.compat.v1.ConfigProto().graph_options.rewrite_options).OFF


@pytest.fixture(autouse=True)
def probe_cache_restored():
    """Each test leaves the process's measured probe as it found it."""
    saved = list(float16_fusion._cache)
    yield
    float16_fusion._cache[:] = saved


@contextlib.contextmanager
def post_optimization_ops():
    """Collects the op types of every function TensorFlow instantiates in the block."""
    ops = []
    eager = context.context()
    eager.enable_run_metadata()
    try:
        yield ops
    finally:
        metadata = eager.export_run_metadata()
        eager.disable_run_metadata()
        ops.extend(node.op for graph in metadata.function_graphs
                   for node in graph.post_optimization_graph.node)


def fused(ops):
    return {op for op in ops if "FusedMatMul" in op}  # _FusedMatMul, _MklFusedMatMul, _MklNativeFusedMatMul


def compiled(policy, slow):
    """A Dense 8-8-2 model compiled under tfmp with `policy`, the trap injected as `slow`."""
    with float16_fusion.injected(slow), warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        with tfmp.policy_scope(policy):
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(2)])
            model.compile("sgd", "mse")
    return model


def scopes_in(function):
    """How many step-scope wrappers the chain of `function` holds."""
    count = 0
    while function is not None:
        count += hasattr(function, "tfmp_scope")
        function = getattr(function, "tfmp_inner", None)
    return count


def test_with_the_trap_a_float16_model_steps_without_fused_matmuls_and_a_float32_model_keeps_them():
    half = compiled("mixed_float16", slow=True)
    single = compiled("float32", slow=True)
    assert half.layers[-1].dtype_policy.name == "float32"  # the head the remapper would fuse
    assert tfmp.attachment(half).remapper.startswith("off: ")
    assert "100 ms with Grappler's remapper on, 1 ms with it off (100x, injected" in tfmp.attachment(half).remapper
    assert tfmp.attachment(single).remapper == "on"
    with post_optimization_ops() as half_ops:
        half.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    with post_optimization_ops() as single_ops:
        single.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    assert "MatMul" in half_ops  # the train function's graph was recorded
    assert fused(half_ops) == set()
    assert fused(single_ops)
    with post_optimization_ops() as other_ops:  # evaluate and predict run in the scope too
        half.evaluate(X, Y, batch_size=4, verbose=0)
        half.predict(X, batch_size=4, verbose=0)
    assert "MatMul" in other_ops and fused(other_ops) == set()


def test_without_the_trap_a_float16_model_has_no_wrapper_and_keeps_the_remapper():
    model = compiled("mixed_float16", slow=False)
    assert tfmp.attachment(model).remapper == "on"
    assert step_scope.scope_of(model) is None
    assert [h for h in patches.installed(model) if h.owner == "step_scope"] == []
    with post_optimization_ops() as ops:
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    assert scopes_in(model.train_function) == 0
    assert fused(ops)  # the float32 output layer, fused by the remapper


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_float32_and_bfloat16_models_are_untouched_even_with_the_trap(policy):
    model = compiled(policy, slow=True)
    assert tfmp.attachment(model).remapper == "on"
    assert step_scope.scope_of(model) is None
    assert [h for h in patches.installed(model) if h.owner == "step_scope"] == []


def test_the_scope_stays_after_disable_and_detach_gives_keras_back():
    model = compiled("mixed_float16", slow=True)  # policy_scope has ended: tfmp is disabled
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    assert step_scope.scope_of(model) == "remapper off"
    assert scopes_in(model.train_function) == 1
    assert {h.name for h in patches.installed(model) if h.owner == "step_scope"} == {
        "make_train_function", "make_test_function", "make_predict_function"}
    tfmp.detach(model)
    assert step_scope.scope_of(model) is None
    assert [h for h in patches.installed(model) if h.owner == "step_scope"] == []
    with post_optimization_ops() as ops:
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    assert scopes_in(model.train_function) == 0
    assert fused(ops)


def test_remove_puts_back_the_function_it_wrapped():
    model = compiled("mixed_float16", slow=True)
    model.make_predict_function()
    wrapper = model.predict_function
    keras_function = wrapper.tfmp_inner
    step_scope.remove(model)
    assert model.predict_function is keras_function
    assert "make_predict_function" not in vars(model)


def test_the_scope_and_the_train_step_checks_wrap_once_each_over_several_fits():
    model = compiled("mixed_float16", slow=True)
    seen = []
    train_function.add_check(model, "numerics", lambda logs: seen.append(1) or logs)
    try:
        for _ in range(2):
            model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
        chain, function = [], model.train_function
        while function is not None:
            chain.append("scope" if hasattr(function, "tfmp_scope") else "other")
            function = getattr(function, "tfmp_inner", None)
        assert chain == ["other", "scope", "other"]  # checks' wrapper, scope, Keras's function
        assert len(seen) == 4  # 2 steps per fit: the check ran once per step
    finally:
        train_function.remove_check(model, "numerics")
    assert scopes_in(model.train_function) == 1


def test_remapper_off_changes_only_this_threads_config_and_restores_it_on_error():
    before = keras_private.function_call_config_now()
    inside, other_thread = [], []
    with pytest.raises(RuntimeError, match="boom"):
        with float16_fusion.remapper_off():
            inside.append(keras_private.function_call_config_now())
            worker = threading.Thread(
                target=lambda: other_thread.append(keras_private.function_call_config_now()))
            worker.start()
            worker.join()
            raise RuntimeError("boom")
    assert inside[0].graph_options.rewrite_options.remapping == OFF
    assert other_thread[0].graph_options.rewrite_options.remapping != OFF
    after = keras_private.function_call_config_now()
    assert after == before and after.graph_options.rewrite_options.remapping != OFF
    before.graph_options.rewrite_options.remapping = OFF
    assert inside[0] == before  # nothing else of the config changed


def test_a_plain_tf_function_is_instantiated_with_and_without_the_remapper():
    @tf.function
    def dense(x, kernel, bias):
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, kernel), bias))

    args = (tf.ones((4, 8)), tf.ones((8, 8)), tf.zeros((8,)))
    with post_optimization_ops() as on:
        dense(*args)
    with post_optimization_ops() as off, float16_fusion.remapper_off():
        dense(*args)
    assert fused(on) and not fused(off) and "MatMul" in off


def test_the_real_probe_measures_once_per_process(monkeypatch):
    float16_fusion.clear_cache()
    calls = []
    real = float16_fusion.measure
    monkeypatch.setattr(float16_fusion, "measure", lambda: calls.append(1) or real())
    first, second = float16_fusion.probe(), float16_fusion.probe()
    assert calls == [1] and second is first
    assert first.source == "measured"
    assert math.isfinite(first.fused_ms) and first.fused_ms > 0
    assert math.isfinite(first.unfused_ms) and first.unfused_ms > 0
    assert first.slow == (first.fused_ms > float16_fusion.SLOW_RATIO * first.unfused_ms)
    float16_fusion.clear_cache()
    float16_fusion.probe()
    assert calls == [1, 1]


def test_injected_results_nest_and_come_off():
    with float16_fusion.injected(True, fused_ms=64.0, unfused_ms=2.0) as outer:
        with float16_fusion.injected(False) as inner:
            assert float16_fusion.probe() is inner
        assert float16_fusion.probe() is outer and outer.ratio == 32.0
    assert float16_fusion._injected == []


def test_the_trap_is_asked_only_for_float16_on_a_cpu():
    with float16_fusion.injected(True) as result:
        assert float16_fusion.remapper_trap("float16", CPU) is result
        assert float16_fusion.remapper_trap("bfloat16", CPU) is None
        assert float16_fusion.remapper_trap("float16", T4) is None
    with float16_fusion.injected(False):
        assert float16_fusion.remapper_trap("float16", CPU) is None


def test_the_float16_cpu_warning_names_a_measured_trap_and_the_workaround():
    """This machine's CPU (no GPU here): the clause comes with a measured trap only."""
    with float16_fusion.injected(True):
        with pytest.warns(tfmp.PerformanceWarning) as caught:
            resolve_policy("mixed_float16")
    message = str(caught[0].message)
    assert "Grappler's remapper fuses each float16 MatMul with its bias add" in message
    assert "100 ms with Grappler" in message  # the injected fused time
    assert "tf.config.optimizer.set_experimental_options({'remapping': False})" in message
    for trap, facts in ((False, None), (True, CPU)):  # no trap here; another machine's CPU
        with float16_fusion.injected(trap):
            with pytest.warns(tfmp.PerformanceWarning) as caught:
                resolve_policy("mixed_float16", device_facts=facts)
        assert "remapping" not in str(caught[0].message)
    with pytest.warns(tfmp.PerformanceWarning) as caught:
        resolve_policy("mixed_bfloat16", device_facts=T4)
    assert "remapping" not in str(caught[0].message)
