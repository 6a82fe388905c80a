"""The fused float16 matmul trap: the facts rule, the per-thread remapper switch, the per-model scope.

What is fused here is read from TensorFlow's RunMetadata (the post-optimization
graph of every function instantiated inside `post_optimization_ops`). On a CPU
whose TensorFlow fuses no float16 matmul (x86 without AVX-512, e.g. Zen 3:
the remapper's CPU fused matmul takes float32, and bfloat16 under oneDNN) the
float16 side is observed through the float32 output layer tfmp forces in a
``mixed_float16`` model: its MatMul and bias add become ``_FusedMatMul`` when
the remapper runs, on any CPU. The trap is decided from the CPU's facts, and the
tests make a Sapphire Rapids (trap) or a Zen 4 (none) this machine's
(`hardware.injected_facts`), so both branches run on any CPU; no test asserts a time.
"""

import math
import threading
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp import DeviceFacts, GpuFacts
from tfmp._src.float32 import conv
from tfmp._src.keras_hooks import patches, runtime_options, step_scope, train_function
from tfmp._src.policy import float16_fusion
from tfmp._src.policy.hardware import injected_facts
from tfmp._src.policy.policy import resolve_policy
from _benchmarks import benchmark_module, quick_run
from _traced import fused_matmuls, post_optimization_ops
from _machines import A100, SAPPHIRE_RAPIDS, SAPPHIRE_RAPIDS_NO_ONEDNN, XEON_NO_BF16, ZEN4

pytestmark = pytest.mark.skipif(
    bool(tf.config.list_physical_devices("GPU")),
    reason="the remapper switch applies to steps on the CPU; this machine has a GPU",
)

X, Y = np.ones((8, 8), "float32"), np.ones((8, 2), "float32")  # batch_size=4: 2 steps
T4 = DeviceFacts(gpus=(GpuFacts("Tesla T4", (7, 5)),))
OFF = type(tf.compat.v1.ConfigProto().graph_options.rewrite_options).OFF


def compiled(policy, slow):
    """A Dense 8-8-2 model compiled under tfmp with `policy` on a Sapphire Rapids (`slow`) or a Zen 4."""
    with injected_facts(SAPPHIRE_RAPIDS if slow else ZEN4), warnings.catch_warnings():
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
    assert "oneDNN takes float16 on this CPU (AVX512_FP16)" in tfmp.attachment(half).remapper
    assert tfmp.attachment(single).remapper == "on"
    with post_optimization_ops() as half_ops:
        half.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    with post_optimization_ops() as single_ops:
        single.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    assert "MatMul" in half_ops  # the train function's graph was recorded
    assert fused_matmuls(half_ops) == set()
    assert fused_matmuls(single_ops)
    with post_optimization_ops() as other_ops:  # evaluate and predict run in the scope too
        half.evaluate(X, Y, batch_size=4, verbose=0)
        half.predict(X, batch_size=4, verbose=0)
    assert "MatMul" in other_ops and fused_matmuls(other_ops) == set()


def test_without_the_trap_a_float16_model_has_no_wrapper_and_keeps_the_remapper():
    model = compiled("mixed_float16", slow=False)
    assert tfmp.attachment(model).remapper == "on"
    assert step_scope.scope_of(model) is None
    assert [h for h in patches.installed(model) if h.owner == "step_scope"] == []
    with post_optimization_ops() as ops:
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    assert scopes_in(model.train_function) == 0
    assert fused_matmuls(ops)  # the float32 output layer, fused by the remapper


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
    assert fused_matmuls(ops)


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
    before = runtime_options.function_call_config_now()
    inside, other_thread = [], []
    with pytest.raises(RuntimeError, match="boom"):
        with float16_fusion.remapper_off():
            inside.append(runtime_options.function_call_config_now())
            worker = threading.Thread(
                target=lambda: other_thread.append(runtime_options.function_call_config_now()))
            worker.start()
            worker.join()
            raise RuntimeError("boom")
    assert inside[0].graph_options.rewrite_options.remapping == OFF
    assert other_thread[0].graph_options.rewrite_options.remapping != OFF
    after = runtime_options.function_call_config_now()
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
    assert fused_matmuls(on) and not fused_matmuls(off) and "MatMul" in off


def test_the_measurement_times_both_variants_and_decides_nothing():
    found = float16_fusion.measure(budget_s=0.05, repeats=2)
    assert found.source == "measured"
    assert math.isfinite(found.fused_ms) and found.fused_ms > 0
    assert math.isfinite(found.unfused_ms) and found.unfused_ms > 0
    assert found.slow == (found.fused_ms > float16_fusion.SLOW_RATIO * found.unfused_ms)
    assert "a float16 Dense training step took" in found.describe()


@pytest.mark.parametrize("facts, trap", [
    (SAPPHIRE_RAPIDS, True), (ZEN4, False), (XEON_NO_BF16, False),
    (SAPPHIRE_RAPIDS_NO_ONEDNN, False), (A100, False),
    (DeviceFacts(cpu_flags=frozenset({"sse2", "avx512bw", "amx_tile", "amx_fp16"})), True),  # Granite Rapids' AMX-FP16
    (DeviceFacts(cpu_flags=frozenset({"sse2", "avx_vnni", "avx_ne_convert"})), True),  # without AVX-512
    (DeviceFacts(cpu_flags=frozenset({"sse2", "avx512_fp16"})), False),  # no AVX512BW: TensorFlow's rule
], ids=["sapphire_rapids", "zen4", "xeon_no_bf16", "sapphire_rapids_no_onednn", "a100",
        "amx_fp16", "avx_ne_convert", "fp16_without_avx512bw"])
def test_the_trap_is_decided_by_the_cpu_facts_for_float16_only(facts, trap):
    found = float16_fusion.remapper_trap("float16", facts)
    assert (found is not None) == trap
    if trap:
        assert found.startswith("TensorFlow's oneDNN takes float16 on this CPU (")
    assert float16_fusion.remapper_trap("bfloat16", facts) is None
    assert float16_fusion.remapper_trap("float32", facts) is None


def test_the_decision_follows_the_injected_machine_not_a_timing(monkeypatch):
    monkeypatch.setattr(float16_fusion, "measure", lambda *a, **k: pytest.fail("measured"))
    with injected_facts(SAPPHIRE_RAPIDS):
        assert float16_fusion.remapper_trap("float16") is not None
        with injected_facts(ZEN4):  # nested: the innermost wins
            assert float16_fusion.remapper_trap("float16") is None
    assert float16_fusion.remapper_trap("float16", ZEN4) is None


def test_the_float16_cpu_warning_names_the_path_taken_where_the_trap_is_and_no_timing():
    with injected_facts(SAPPHIRE_RAPIDS):
        with pytest.warns(tfmp.PerformanceWarning) as caught:
            resolve_policy("mixed_float16")
    message = str(caught[0].message)
    assert "tfmp trains it without Grappler's slow fused float16 MatMul" in message.splitlines()[0]
    assert message.endswith("troubleshooting.md#no-speed-up")  # the guide says the rest (step_scope, convolutions)
    assert " ms" not in message and "0.0012x" not in message
    for facts in (ZEN4, XEON_NO_BF16):  # no trap on those CPUs
        with pytest.warns(tfmp.PerformanceWarning) as caught:
            resolve_policy("mixed_float16", device_facts=facts)
        assert "fused" not in str(caught[0].message)
    with pytest.warns(tfmp.PerformanceWarning) as caught:
        resolve_policy("mixed_bfloat16", device_facts=T4)
    assert "fused" not in str(caught[0].message)


@pytest.mark.parametrize("slow", [True, False], ids=["sapphire_rapids", "zen4"])
def test_a_custom_loop_in_step_scope_runs_the_graph_fit_runs(slow):
    model = compiled("mixed_float16", slow=slow)

    @tf.function
    def step(x):
        return model(x)

    with post_optimization_ops() as in_scope:
        with tfmp.step_scope(model) as name:
            step(tf.ones((4, 8)))
    assert name == ("remapper off" if slow else None)
    # Which matmuls the remapper fuses: none with it off; with it on at least the float32
    # output layer on any CPU (and the float16 one too where the real CPU's oneDNN takes
    # float16, which the injected facts do not change).
    assert bool(fused_matmuls(in_scope)) is not slow
    if slow:
        assert "MatMul" in in_scope  # the step's graph was recorded, unfused
    with post_optimization_ops() as fit_ops:
        model.predict(X, batch_size=4, verbose=0)
    assert bool(fused_matmuls(fit_ops)) is not slow


def test_step_scope_refuses_what_is_not_a_model_and_passes_through_a_model_not_attached():
    with pytest.raises(ValueError, match=r"Invalid `model` argument. Expected a keras.Model \(one "
                                         r"compiled under tfmp gets its step's graph options\). "
                                         r"Received: model=3"):
        with tfmp.step_scope(3):
            pass
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    with tfmp.step_scope(plain) as name:
        assert name is None
    with pytest.raises(RuntimeError, match="boom"):  # an error leaves the thread's config as it was
        with tfmp.step_scope(compiled("mixed_float16", slow=True)):
            raise RuntimeError("boom")
    assert runtime_options.function_call_config_now().graph_options.rewrite_options.remapping != OFF


def test_the_float16_cpu_benchmark_runs_and_its_tables_hang_together(tmp_path):
    benchmark, written = quick_run("float16_cpu", tmp_path)
    assert list(written["models"]) == ["MLP", "CNN", "DepthwiseConv2D", "SeparableConv1D"]
    for kind, variants in written["models"].items():
        assert list(variants) == list(benchmark.variants_of(kind))
        assert variants["float32"]["vs_float32"] == {"value": 1.0, "paired": 1.0, "fastest": 1.0}
        for found in variants.values():  # none over the step budget at these sizes
            assert len(found["ms"]) == 2 and found["fastest_ms"] == min(found["ms"]) > 0
        assert variants["float32"]["remapper"] == variants["Keras float16"]["remapper"] == "plain Keras"
    assert written["models"]["CNN"]["tfmp fit, remapper off"]["remapper"].startswith("off: ")
    assert written["conv_by_facts"] == {"conv": conv.decision("float16"),
                                        "depthwise_conv": conv.depthwise_decision("float16")}
    assert written["fused_matmul"].startswith("a float16 Dense training step took ")
    assert written["remapper_trap_by_facts"] is (float16_fusion.remapper_trap("float16") is not None)
    text = benchmark.markdown(written)
    assert "MLP:" in text and "| tfmp fit, remapper off |" in text and "| tfmp, float32 inside |" in text
    # a variant over its budget is reported as a bound, from its one step timed alone
    written["models"]["CNN"]["Keras float16"] = {"ms": [99.0], "over_budget": True, "remapper": "plain Keras"}
    bound = f"| Keras float16 | 99.00 (one step) |  | > {benchmark.STEP_BUDGET:g}x slower |"
    assert bound in benchmark.markdown(written)


def test_the_float16_cpu_benchmark_leaves_a_step_over_its_budget_out_of_the_timing():
    float16_cpu = benchmark_module("float16_cpu")
    calls = []
    steps = {"float32": lambda: calls.append("float32"), "slow": lambda: calls.append("slow")}
    assert float16_cpu.over_budget(steps, budget=0.0).keys() == {"slow"}  # any time is over 0x
    assert float16_cpu.over_budget(steps, budget=1e9) == {}
    assert calls == ["float32", "slow"] * 2  # each step once per check
