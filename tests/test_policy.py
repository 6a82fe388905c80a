"""The hardware rules of "auto", explicit policies, and their error messages."""

import warnings

import keras
import pytest

import tfmp
from tfmp import DeviceFacts, GpuFacts
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
