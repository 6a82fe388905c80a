"""The hardware rules of "auto", explicit policies, and their error messages."""

import warnings

import keras
import pytest
from _machines import SAPPHIRE_RAPIDS, ZEN4

import tfmp
from tfmp import DeviceFacts, GpuFacts
from tfmp._src.errors import guide
from tfmp._src.policy import policy as _policy
from tfmp._src.policy.hardware import injected_facts
from tfmp._src.policy.policy import resolve_policy

P100 = DeviceFacts(gpus=(GpuFacts("Tesla P100-PCIE-16GB", (6, 0)),))
V100 = DeviceFacts(gpus=(GpuFacts("Tesla V100-SXM2-16GB", (7, 0)),))
T4 = DeviceFacts(gpus=(GpuFacts("Tesla T4", (7, 5)),))
A100 = DeviceFacts(gpus=(GpuFacts("NVIDIA A100-SXM4-40GB", (8, 0)),))
H100 = DeviceFacts(gpus=(GpuFacts("NVIDIA H100 80GB HBM3", (9, 0)),))
TPU = DeviceFacts(tpu=True, cpu_name="Intel Xeon")
CPU_AVX512_BF16 = DeviceFacts(cpu_name="AMD EPYC", cpu_flags=frozenset({"avx512f", "avx512_bf16"}))
CPU_AMX_BF16 = DeviceFacts(cpu_name="Intel Xeon Platinum 8480+", cpu_flags=frozenset({"amx_bf16"}))
CPU_PLAIN = DeviceFacts(cpu_name="Intel Core i7-8700", cpu_flags=frozenset({"avx2", "avx512f"}))


@pytest.mark.parametrize(
    "facts, policy, fact_in_reason, tf32",
    [
        (P100, "float32", "6.0", False),
        (V100, "mixed_float16", "7.0", False),
        (T4, "mixed_float16", "7.5", False),
        (A100, "mixed_bfloat16", "8.0", True),
        (H100, "mixed_bfloat16", "9.0", True),
        (TPU, "mixed_bfloat16", "TPU", None),
        (CPU_AVX512_BF16, "mixed_bfloat16", "AVX512_BF16", None),
        (CPU_AMX_BF16, "mixed_bfloat16", "AMX_BF16", None),
        (CPU_PLAIN, "float32", "AVX512_BF16", None),
    ],
    ids=["P100", "V100", "T4", "A100", "H100", "TPU", "cpu-avx512bf16", "cpu-amx", "cpu-plain"],
)
def test_auto_rules(facts, policy, fact_in_reason, tf32):
    decision = tfmp.recommend_policy(facts)
    assert decision.policy == policy
    assert fact_in_reason in decision.reason
    assert decision.tf32 is tf32
    text = str(decision)
    assert policy in text and decision.device in text
    assert 1 <= text.count(". ") + 1 <= 3  # one or two sentences, plus TF32 note


def test_weakest_gpu_decides():
    facts = DeviceFacts(gpus=A100.gpus + T4.gpus)
    decision = tfmp.recommend_policy(facts)
    assert decision.policy == "mixed_float16"
    assert "Tesla T4" in decision.device


def test_recommend_policy_has_no_side_effects():
    before = keras.config.dtype_policy().name
    tfmp.recommend_policy(A100)
    assert keras.config.dtype_policy().name == before


def test_decision_dtypes():
    decision = tfmp.recommend_policy(V100)
    assert (decision.compute_dtype, decision.variable_dtype) == ("float16", "float32")
    assert decision.loss_scaling
    assert not tfmp.recommend_policy(A100).loss_scaling


def test_unknown_policy_message_suggests_alias():
    with pytest.raises(ValueError) as info:
        resolve_policy("fp16", device_facts=V100)
    assert str(info.value) == (
        "Invalid `policy` argument. Expected one of 'auto', 'mixed_float16', "
        "'mixed_bfloat16', 'float32'. Received: policy='fp16' (of type str). "
        "Did you mean 'mixed_float16'?"
    )


@pytest.mark.parametrize(
    "typo, meant", [("mixed_flaot16", "mixed_float16"), ("bf16", "mixed_bfloat16"), ("fp32", "float32")]
)
def test_typos_get_suggestions(typo, meant):
    with pytest.raises(ValueError, match=f"Did you mean '{meant}'"):
        resolve_policy(typo, device_facts=A100)


def test_recommend_policy_refuses_a_policy_name():
    with pytest.raises(ValueError, match=r"Received: device_facts='mixed_float16'.*tfmp.enable\(policy\)"):
        tfmp.recommend_policy("mixed_float16")


def test_non_string_policy_rejected():
    with pytest.raises(ValueError, match=r"Received: policy=16 \(of type int\)"):
        resolve_policy(16, device_facts=A100)


@pytest.mark.parametrize("pure", ["float16", "bfloat16"])
def test_pure_16bit_refused_unless_opted_in(pure):
    with pytest.raises(ValueError, match="no float32 master weights") as info:
        resolve_policy(pure, device_facts=A100)
    assert f"'mixed_{pure}'" in str(info.value)
    assert "allow_pure_16bit=True" in str(info.value)
    assert resolve_policy(pure, allow_pure_16bit=True, device_facts=A100).policy == pure


def test_dtype_policy_object_accepted():
    decision = resolve_policy(keras.DTypePolicy("mixed_bfloat16"), device_facts=A100)
    assert decision.policy == "mixed_bfloat16"


@pytest.mark.parametrize(
    "policy, facts, slow",
    [
        ("mixed_float16", CPU_AVX512_BF16, True),
        ("mixed_float16", P100, True),
        ("mixed_bfloat16", T4, True),
        ("mixed_bfloat16", CPU_PLAIN, True),
        ("mixed_float16", V100, False),
        ("mixed_bfloat16", CPU_AVX512_BF16, False),
        ("mixed_bfloat16", TPU, False),
        ("float32", P100, False),
    ],
)
def test_slow_explicit_policy_warns_once(policy, facts, slow):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decision = resolve_policy(policy, device_facts=facts)
    perf = [w for w in caught if issubclass(w.category, tfmp.PerformanceWarning)]
    assert decision.policy == policy  # honoured either way
    assert len(perf) == (1 if slow else 0)
    if slow:
        message = str(perf[0].message)
        assert "slower than float32" in message
        assert tfmp.recommend_policy(facts).policy in message
        assert "slower than float32" in decision.reason


def test_gpu_with_unknown_compute_capability_gets_float32():
    facts = DeviceFacts(gpus=A100.gpus + (GpuFacts("Mystery GPU", None),))
    decision = tfmp.recommend_policy(facts)
    assert decision.policy == "float32"
    assert "did not report" in decision.reason
    assert "Mystery GPU" in decision.device
    with pytest.warns(tfmp.PerformanceWarning, match="compute capability is unknown"):
        resolve_policy("mixed_bfloat16", device_facts=facts)


# The CPU's measured step (tfmp.SpeedProbe) --------------------------------------------

FAST_BF16 = tfmp.SpeedProbe(float32_ms=2.0, bfloat16_ms=1.0, float16_ms=100.0)  # 2.0x, 0.02x
SLOW_BF16 = tfmp.SpeedProbe(float32_ms=1.0, bfloat16_ms=2.0, float16_ms=50.0)  # 0.5x, 0.02x


def test_an_injected_probe_is_quoted_with_its_factor():
    decision = tfmp.recommend_policy(CPU_AVX512_BF16, speed_probe=FAST_BF16)
    assert decision.policy == "mixed_bfloat16"
    assert decision.reason == (
        "The CPU has AVX512_BF16, so oneDNN runs bfloat16 matmuls in hardware (measured "
        "here: a bfloat16 training step runs 2.0x float32's speed).")


def test_a_slow_measured_bfloat16_step_is_advice_and_never_changes_the_policy():
    decision = tfmp.recommend_policy(CPU_AMX_BF16, speed_probe=SLOW_BF16)
    assert decision.policy == tfmp.recommend_policy(CPU_AMX_BF16).policy == "mixed_bfloat16"
    assert decision.reason == (
        "The CPU has AMX_BF16, so oneDNN runs bfloat16 matmuls in hardware (measured here: a "
        "bfloat16 training step runs 0.5x float32's speed). That measurement is below 0.7x: "
        "where it holds on an idle machine (tfmp doctor measures with its spread), pin float32 "
        "with tfmp.enable('float32').")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfmp.PerformanceWarning)  # no warning: by the flags
        explicit = resolve_policy("mixed_bfloat16", device_facts=CPU_AMX_BF16, speed_probe=SLOW_BF16)
    assert explicit.reason == "Requested explicitly."


def test_injected_facts_without_a_probe_quote_no_figure():
    for facts in (CPU_AVX512_BF16, CPU_PLAIN):
        reason = tfmp.recommend_policy(facts).reason
        assert "measured" not in reason and "Zen 4" not in reason and "1.88" not in reason


def test_plain_cpu_reason_quotes_the_measured_bfloat16_factor():
    decision = tfmp.recommend_policy(CPU_PLAIN, speed_probe=SLOW_BF16)
    assert decision.policy == "float32"
    assert "(measured here: a bfloat16 training step runs 0.5x float32's speed)" in decision.reason


@pytest.mark.parametrize("facts", [A100, V100, TPU], ids=["A100", "V100", "TPU"])
def test_gpu_and_tpu_rules_ignore_a_probe(facts):
    assert tfmp.recommend_policy(facts, speed_probe=SLOW_BF16) == tfmp.recommend_policy(facts)


def test_float16_warning_quotes_the_factor_and_the_kernels():
    with pytest.warns(tfmp.PerformanceWarning) as caught:
        decision = resolve_policy("mixed_float16", device_facts=CPU_AVX512_BF16,
                                  speed_probe=SLOW_BF16)
    [message] = [str(w.message) for w in caught]
    assert message == (
        "Policy 'mixed_float16' is slower than float32 here.\nA float16 training step measured "
        "0.02x float32's speed on this CPU (CPU 'AMD EPYC' (avx512_bf16)): TensorFlow has no "
        "fast float16 CPU kernels for training.\nFix: tfmp.enable('auto') (which picks "
        "'mixed_bfloat16') or tfmp.enable('float32').\nGuide: " + guide("no-speed-up"))
    assert "no float16 arithmetic" not in decision.reason


def test_float16_warning_without_a_probe_names_the_kernels_not_the_instructions():
    sapphire_rapids = DeviceFacts(cpu_name="Intel Xeon Platinum 8480+",
                                  cpu_flags=frozenset({"avx512_fp16", "amx_bf16", "avx512_bf16"}))
    slow = _policy.slower_than_float32("mixed_float16", sapphire_rapids)
    assert slow == ("TensorFlow has no fast float16 CPU kernels for training "
                    "(CPU 'Intel Xeon Platinum 8480+' (avx512_bf16, amx_bf16))")


def test_float16_warning_at_break_even_still_names_the_kernels():
    even = tfmp.SpeedProbe(float32_ms=2.0, bfloat16_ms=2.0, float16_ms=2.0)
    slow = _policy.slower_than_float32("mixed_float16", CPU_PLAIN, even)
    assert slow == ("TensorFlow has no fast float16 CPU kernels for training (a float16 "
                    "training step measured 1.0x float32's speed on this CPU (CPU 'Intel "
                    "Core i7-8700' (no bfloat16 flags))), and float16 needs loss scaling at "
                    "every step")


def test_a_probe_that_is_not_a_speed_probe_is_refused():
    with pytest.raises(ValueError, match=r"Invalid `speed_probe` argument. Expected None or a "
                                         r"tfmp.SpeedProbe. Received: speed_probe=1.5"):
        tfmp.recommend_policy(CPU_PLAIN, speed_probe=1.5)


def test_nothing_is_measured_to_decide_on_any_machine(monkeypatch):
    """No timing decides "auto" or checks an explicit policy: not on this machine, nor injected."""
    from tfmp._src.policy import speed_probe

    monkeypatch.setattr(speed_probe, "_measure", lambda: pytest.fail("measured"))
    for facts in (CPU_AVX512_BF16, CPU_AMX_BF16, CPU_PLAIN, A100):
        with injected_facts(facts):
            assert tfmp.recommend_policy() == tfmp.recommend_policy(facts)
            assert resolve_policy("auto") == tfmp.recommend_policy(facts)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", tfmp.PerformanceWarning)
                for name in ("mixed_bfloat16", "mixed_float16", "float32"):
                    resolve_policy(name)
    assert tfmp.recommend_policy().reason == tfmp.recommend_policy().reason


def test_a_bfloat16_step_at_exactly_the_floor_factor_gets_no_advice_to_pin_float32():
    """The advice to pin float32 starts below `MIN_BFLOAT16_FACTOR` (0.7x float32's speed), not at it."""
    at_floor = tfmp.SpeedProbe(float32_ms=7.0, bfloat16_ms=10.0, float16_ms=50.0)
    assert at_floor.factor("bfloat16") == _policy.MIN_BFLOAT16_FACTOR
    decision = tfmp.recommend_policy(CPU_AMX_BF16, speed_probe=at_floor)
    assert decision.policy == "mixed_bfloat16"
    assert decision.reason.endswith("runs 0.7x float32's speed).")


@pytest.mark.parametrize("policy", ["mixed_bf16", "float64", "auto"])
def test_a_hand_made_decision_with_a_string_that_is_no_policy_tfmp_applies_is_refused(policy):
    """`PolicyDecision` checks that its policy is a string and one tfmp applies (both)."""
    with pytest.raises(ValueError, match="Invalid `policy` argument"):
        tfmp.PolicyDecision(policy, "reason", "device")


@pytest.mark.parametrize("facts, kernels", [(SAPPHIRE_RAPIDS, "oneDNN"), (ZEN4, "none")])
def test_the_float16_warning_on_a_cpu_names_the_kernels_the_cpu_has(facts, kernels):
    slow = _policy.slower_than_float32("mixed_float16", facts)
    if kernels == "oneDNN":
        assert slow.startswith("oneDNN's float16 CPU kernels train slower than float32 (CPU 'Intel Xeon")
        assert "no fast float16 CPU kernels" not in slow
    else:
        assert slow.startswith("TensorFlow has no fast float16 CPU kernels for training (CPU 'AMD EPYC (Zen 4)'")


@pytest.mark.parametrize("probe", [None, tfmp.SpeedProbe(float32_ms=2.0, bfloat16_ms=1.0, float16_ms=40.0)])
def test_the_policy_line_of_a_slow_explicit_policy_names_the_device_once(probe):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        decision = resolve_policy("mixed_float16", device_facts=ZEN4, speed_probe=probe)
    line = str(decision)
    assert line.count("AMD EPYC (Zen 4)") == 1, line
    assert line.startswith("tfmp policy: mixed_float16 on CPU 'AMD EPYC (Zen 4)' (avx512_bf16). Requested "
                           "explicitly; it is slower than float32 here: ")
