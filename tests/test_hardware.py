"""Device detection: TensorFlow's device lists, GPU details and CPU flags (archspec)."""

import os
import platform

import archspec.cpu
import pytest
import tensorflow as tf
from archspec.cpu import detect

import tfmp
from tfmp._src.policy import hardware as _hardware


class _FakeDevice:
    def __init__(self, name):
        self.name = name
        self.device_type = "GPU"


def test_gpu_details_are_read_from_tensorflow(monkeypatch):
    devices = [_FakeDevice("/physical_device:GPU:0"), _FakeDevice("/physical_device:GPU:1")]
    details = {
        devices[0].name: {"device_name": "Tesla T4", "compute_capability": (7, 5)},
        devices[1].name: {"device_name": "Mystery GPU"},
    }
    monkeypatch.setattr(
        tf.config, "list_physical_devices", lambda kind=None: devices if kind == "GPU" else []
    )
    monkeypatch.setattr(
        tf.config.experimental, "get_device_details", lambda device: details[device.name]
    )
    gpus = _hardware._read_gpus()
    assert gpus == (
        tfmp.GpuFacts("Tesla T4", (7, 5)),
        tfmp.GpuFacts("Mystery GPU", None),
    )
    facts = tfmp.DeviceFacts(gpus=gpus)
    assert facts.weakest_gpu.name == "Mystery GPU"  # unknown counts as weakest
    assert facts.weakest_gpu.cc_string == "unknown"
    assert facts.min_compute_capability is None
    assert tfmp.DeviceFacts(gpus=gpus[:1]).min_compute_capability == (7, 5)


def test_detection_is_cached():
    assert _hardware.detect_device_facts() is _hardware.detect_device_facts()


def test_cpu_name_and_flags_from_archspec_targets():
    name, flags = _hardware.cpu_from_archspec(
        archspec.cpu.TARGETS["zen4"], brand="AMD EPYC 9654 96-Core Processor")
    assert name == "AMD EPYC 9654 96-Core Processor"
    assert {"avx2", "avx512f", "avx512_bf16"} <= flags
    assert tfmp.DeviceFacts(cpu_flags=flags).cpu_bf16_flags == ("avx512_bf16",)
    # Without a brand string (Arm on Linux): vendor and microarchitecture name.
    assert _hardware.cpu_from_archspec(archspec.cpu.TARGETS["neoverse_v1"])[0] == (
        "ARM neoverse_v1")


def _partial(vendor, flag_line):
    """What archspec reads from a CPU itself: a partial microarchitecture of its flags."""
    return detect.partial_uarch(vendor=vendor, features=set(flag_line.split()))


# CPUs as archspec names them (its target) and the flags read from the CPU itself
# (shortened /proc/cpuinfo flag lines), with what "auto" must decide.
CPU_CASES = {
    "zen4": (
        "zen4", _partial("AuthenticAMD", "fpu sse2 avx2 avx512f avx512bw avx512_bf16"),
        "AMD EPYC 9654 96-Core Processor", "mixed_bfloat16", "(avx512_bf16)",
    ),
    "sapphire_rapids": (
        "sapphirerapids", _partial("GenuineIntel", "fpu avx2 avx512f avx512_bf16 amx_bf16"),
        "Intel(R) Xeon(R) Platinum 8480+", "mixed_bfloat16", "(avx512_bf16, amx_bf16)",
    ),
    # archspec 0.2.7 has no Cooper Lake target: named cascadelake, bf16 from its flags.
    "cooper_lake": (
        "cascadelake", _partial("GenuineIntel", "fpu avx2 avx512f avx512_vnni avx512_bf16"),
        "Intel(R) Xeon(R) Platinum 8380H", "mixed_bfloat16", "(avx512_bf16)",
    ),
    # A CPU archspec cannot name (generic x86_64) whose flags show AMX-BF16.
    "amx_only": (
        "x86_64", _partial("GenuineIntel", "fpu avx2 amx_bf16 amx_tile"),
        "Some AMX CPU", "mixed_bfloat16", "(amx_bf16)",
    ),
    # AVX-512 with VNNI and BW but no bfloat16 instructions.
    "cascade_lake": (
        "cascadelake", _partial("GenuineIntel", "fpu avx2 avx512f avx512bw avx512_vnni"),
        "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz", "float32", "(no bfloat16 flags)",
    ),
    "skylake_avx512": (
        "skylake_avx512", None, "Intel(R) Xeon(R) Gold 6148", "float32", "(no bfloat16 flags)",
    ),
    # Arm FEAT_BF16 ("bf16" in the Features line): AWS Graviton3 and Graviton4.
    "neoverse_v1": (
        "neoverse_v1", _partial("ARM", "fp asimd sve bf16 svebf16 i8mm"),
        None, "mixed_bfloat16", "(bf16)",
    ),
    # Graviton4 / Grace: BF16, but TensorFlow turns oneDNN on by default for Neoverse V1 only.
    "neoverse_v2": ("neoverse_v2", None, None, "float32", "(bf16; oneDNN off)"),
    # Graviton2: no BF16.
    "neoverse_n1": ("neoverse_n1", _partial("ARM", "fp asimd atomics"), None, "float32",
                    "(no bfloat16 flags)"),
    # Apple M2: archspec reads no flags on macOS; the m2 target lists bf16, but
    # TensorFlow has no oneDNN kernels on macOS.
    "apple_m2": ("m2", detect.partial_uarch(name="m2", vendor="Apple"), "Apple M2",
                 "float32", "(bf16; oneDNN off)", "Darwin"),
    "no_flags": ("x86_64", None, "Mystery CPU", "float32", "(no bfloat16 flags)"),
}
# Without a brand string (Arm on Linux) a CPU is named by archspec's vendor and target.
NAMES_WITHOUT_BRAND = {"neoverse_v1": "ARM neoverse_v1", "neoverse_v2": "ARM neoverse_v2",
                       "neoverse_n1": "ARM neoverse_n1"}


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_auto_decides_from_what_archspec_reports(case, monkeypatch):
    """From archspec's detection to the decision, with the expectation written out."""
    target, detected, brand, policy, flags, system = (CPU_CASES[case] + ("Linux",))[:6]
    monkeypatch.setattr(platform, "system", lambda: system)
    monkeypatch.delenv(_hardware.ONEDNN_ENV, raising=False)
    monkeypatch.setattr(archspec.cpu, "host", lambda: archspec.cpu.TARGETS[target])
    monkeypatch.setattr(detect, "detected_info", lambda: detected or _partial("", ""))
    monkeypatch.setattr(archspec.cpu, "brand_string", lambda: brand)
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    facts = _hardware._read_device_facts.__wrapped__()  # uncached: reads the fakes
    name = brand or NAMES_WITHOUT_BRAND[case]
    decision = tfmp.recommend_policy(facts)
    assert (decision.policy, decision.device) == (policy, f"CPU '{name}' {flags}")


ZEN4 = dict(cpu_name="AMD EPYC", cpu_flags=frozenset({"sse2", "avx512_bf16"}), cpu_target="zen4")
#: x86 CPUs without bfloat16: Cascade Lake has AVX512_VNNI (oneDNN on by default on
#: Linux), Zen 3 none of TensorFlow's oneDNN flags (off).
CASCADE_LAKE = dict(cpu_name="Intel Xeon", cpu_flags=frozenset({"sse2", "avx512f", "avx512_vnni"}),
                    cpu_target="cascadelake")
ZEN3 = dict(cpu_name="AMD EPYC", cpu_flags=frozenset({"sse2", "avx2", "fma"}), cpu_target="zen3")
V2 = dict(cpu_name="ARM neoverse_v2", cpu_flags=frozenset({"bf16"}), cpu_target="neoverse_v2")


@pytest.mark.parametrize("facts, env, system, onednn", [
    (CASCADE_LAKE, None, "Linux", True), (ZEN3, None, "Linux", False), (ZEN3, "1", "Linux", True),
    (ZEN3, None, "Windows", True), (dict(ZEN3, cpu_flags=frozenset({"sse2", "avx_vnni"})), None, "Linux", True),
    (dict(ZEN3, cpu_flags=frozenset({"sse2", "amx_tile"})), None, "Linux", True),
])
def test_onednn_default_on_linux_x86_needs_one_of_tensorflows_flags(facts, env, system, onednn):
    device = tfmp.DeviceFacts(system=system, onednn_env=env, **facts)
    assert device.onednn is onednn
    assert device.onednn_float16 is False  # no float16 flag in any of them
    assert tfmp.recommend_policy(device).policy == "float32"  # and no bfloat16 flag


@pytest.mark.parametrize("flags, env, expected", [
    ({"sse2", "avx512f", "avx512_vnni"}, None, True),  # Cascade Lake: bfloat16 emulated on AVX-512
    ({"sse2", "avx512f", "avx512_vnni"}, "0", False),
    ({"sse2", "avx2", "avx_vnni", "avx_ne_convert"}, None, True),  # AVX-NE-CONVERT without AVX-512
    ({"sse2", "avx2"}, "1", False),  # Zen 3 with oneDNN forced on: Eigen's bfloat16
])
def test_onednn_bfloat16_follows_tensorflows_rule(flags, env, expected):
    """TensorFlow 2.21 ``IsDataTypeSupportedByOneDNNOnThisCPU(DT_BFLOAT16)``, written out."""
    assert tfmp.DeviceFacts(cpu_flags=frozenset(flags), onednn_env=env).onednn_bfloat16 is expected


def test_the_onednn_rule_says_what_tensorflow_does_on_this_machine():
    """The rule against TensorFlow's own answer here (`IsMklEnabled`), so a TensorFlow
    release that changes its default, or a CPU the rule misreads, fails here."""
    from tensorflow.python.util import _pywrap_util_port

    facts = _hardware._read_device_facts()  # this machine's, never injected ones
    assert facts.onednn is bool(_pywrap_util_port.IsMklEnabled()), facts


@pytest.mark.parametrize("facts, env, system, onednn", [
    (ZEN4, None, "Linux", True), (ZEN4, "0", "Linux", False), (ZEN4, "False", "Linux", False),
    (ZEN4, None, "Windows", True), (V2, None, "Linux", False), (V2, "1", "Linux", True),
    (V2, "TRUE", "Darwin", True), (V2, "yes", "Linux", False),  # TensorFlow ignores "yes"
    (dict(V2, cpu_target="neoverse_v1"), None, "Linux", True),
    (dict(V2, cpu_target="m2"), None, "Darwin", False),
])
def test_onednn_rule_follows_tensorflow(facts, env, system, onednn):
    device = tfmp.DeviceFacts(system=system, onednn_env=env, **facts)
    assert device.onednn is onednn
    decision = tfmp.recommend_policy(device)
    assert decision.policy == ("mixed_bfloat16" if onednn else "float32")
    warning = tfmp._src.policy.policy.slower_than_float32("mixed_bfloat16", device)
    if onednn:
        assert warning is None
    else:
        assert "oneDNN is off" in decision.reason and "TF_ENABLE_ONEDNN_OPTS=1" in decision.reason
        # Why it is off: the variable's value when set, else the system's default.
        why = f"TF_ENABLE_ONEDNN_OPTS={env}" if env else f"the default on {system} here"
        assert f"oneDNN is off ({why}): " in decision.reason
        assert warning == decision.reason  # the warning of an explicit policy says the same


def test_onednn_setting_is_read_from_the_environment(monkeypatch):
    # The system and CPU are faked too, so that what detection reads is known here.
    monkeypatch.setenv(_hardware.ONEDNN_ENV, "0")
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    monkeypatch.setattr(archspec.cpu, "host", lambda: archspec.cpu.TARGETS["zen2"])
    monkeypatch.setattr(detect, "detected_info", lambda: _partial("AuthenticAMD", "fpu sse2 avx2"))
    monkeypatch.setattr(archspec.cpu, "brand_string", lambda: "AMD EPYC 7502")
    facts = _hardware._read_device_facts.__wrapped__()
    assert facts.onednn_env == "0" and facts.onednn is False  # on by default on Windows x86
    assert (facts.system, facts.cpu_target, facts.cpu_name) == ("Windows", "zen2", "AMD EPYC 7502")
    assert {"sse2", "avx2"} <= facts.cpu_flags and facts.cpu_bf16_flags == ()
    assert (facts.gpus, facts.tpu) == ((), False)


def test_arm_reason_does_not_claim_the_zen4_measurement():
    arm = tfmp.DeviceFacts(cpu_name="ARM neoverse_v1", cpu_flags=frozenset({"sve", "bf16"}),
                           cpu_target="neoverse_v1")
    reason = tfmp.recommend_policy(arm).reason
    assert reason.startswith("The CPU has BF16, so oneDNN runs bfloat16 matmuls")
    assert "not measured by tfmp" in reason and "Zen 4" not in reason


def _this_cpu_flags():
    """The flags of this machine's CPU, read here independently of tfmp."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            return set(value.split())
    return set()


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="decides for a GPU")
@pytest.mark.skipif(_this_cpu_flags() is None, reason="no /proc/cpuinfo to check against")
def test_this_cpu_machine():
    # The rule written out: hardware bfloat16 is AVX512_BF16, AMX-BF16 or Arm BF16,
    # used through TensorFlow's oneDNN kernels (on by default for x86 on Linux).
    x86_bf16 = bool({"avx512_bf16", "amx_bf16"} & _this_cpu_flags())
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").lower() not in ("0", "false")
    arm_bf16 = "bf16" in _this_cpu_flags() and archspec.cpu.host().name == "neoverse_v1"
    has_bf16 = (x86_bf16 or arm_bf16) and onednn
    decision = tfmp.recommend_policy()
    # By the facts alone: no timing is taken, and none is quoted.
    assert decision.policy == ("mixed_bfloat16" if has_bf16 else "float32")
    assert decision.device.startswith("CPU '")
    assert "measured" not in decision.reason


def test_injected_facts_are_this_machines_in_every_thread_nested_and_come_off():
    import threading

    detected = _hardware.detect_device_facts()
    outer = tfmp.DeviceFacts(cpu_name="outer")
    inner = tfmp.DeviceFacts(cpu_name="inner")
    seen = []
    with _hardware.injected_facts(outer):
        with _hardware.injected_facts(inner):
            worker = threading.Thread(target=lambda: seen.append(_hardware.detect_device_facts()))
            worker.start()
            worker.join()
            assert _hardware.detect_device_facts() is inner
        assert _hardware.detect_device_facts() is outer
    assert seen == [inner]
    assert _hardware.detect_device_facts() is detected
    with pytest.raises(ValueError, match=r"Invalid `facts` argument. Expected a tfmp.DeviceFacts. "
                                         r"Received: facts='zen4'"):
        with _hardware.injected_facts("zen4"):
            pass


@pytest.mark.parametrize("flags, env, expected", [
    ({"sse2", "avx512bw", "avx512_vnni", "avx512_fp16"}, None, True),  # Sapphire Rapids
    ({"sse2", "avx512bw", "avx512_vnni", "amx_fp16"}, None, True),  # AMX-FP16 (Granite Rapids)
    ({"sse2", "avx_vnni", "avx_ne_convert"}, None, True),  # AVX-NE-CONVERT without AVX-512
    ({"sse2", "avx512_vnni", "avx512_fp16"}, None, False),  # AVX512_FP16 needs AVX512BW too
    ({"sse2", "avx512bw", "avx512_bf16"}, None, False),  # Zen 4: bfloat16 only
    ({"sse2", "avx512bw", "avx512_vnni", "avx512_fp16"}, "0", False),  # oneDNN off: Eigen's float16
    ({"sse2", "avx_ne_convert"}, None, False),  # no oneDNN default flag: oneDNN off
])
def test_onednn_float16_follows_tensorflows_rule(flags, env, expected):
    """TensorFlow 2.21 ``IsDataTypeSupportedByOneDNNOnThisCPU(DT_HALF)``, written out."""
    facts = tfmp.DeviceFacts(cpu_flags=frozenset(flags), onednn_env=env)
    assert facts.onednn_float16 is expected
