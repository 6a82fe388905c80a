"""Device detection: TensorFlow's device lists, GPU details and CPU flags."""

import pytest
import tensorflow as tf

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


def test_cpu_flags_parsed_from_cpuinfo(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
    )
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k),
    )
    name, flags = _hardware._read_cpu_info()
    assert name == "AMD EPYC 9654"
    assert flags == frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})
    assert tfmp.DeviceFacts(cpu_flags=flags).cpu_bf16_flags == ("avx512_bf16",)


# /proc/cpuinfo flag lines of real CPUs (shortened) and what "auto" must decide.
CPUINFO_CASES = {
    "zen4": (
        "AMD EPYC 9654 96-Core Processor",
        "fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16",
        "mixed_bfloat16",
        "CPU 'AMD EPYC 9654 96-Core Processor' (avx512_bf16)",
    ),
    "sapphire_rapids": (
        "Intel(R) Xeon(R) Platinum 8480+",
        "fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8",
        "mixed_bfloat16",
        "CPU 'Intel(R) Xeon(R) Platinum 8480+' (avx512_bf16, amx_bf16)",
    ),
    "amx_only": (
        "Some AMX CPU",
        "fpu avx2 amx_bf16 amx_tile",
        "mixed_bfloat16",
        "CPU 'Some AMX CPU' (amx_bf16)",
    ),
    # AVX-512 with VNNI and BW but no bfloat16 instructions (Cascade Lake).
    "cascade_lake": (
        "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz",
        "fpu avx2 avx512f avx512bw avx512_vnni",
        "float32",
        "CPU 'Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz' (no bfloat16 flags)",
    ),
    "no_flags": ("Mystery CPU", "", "float32", "CPU 'Mystery CPU' (no bfloat16 flags)"),
}


@pytest.mark.parametrize("case", sorted(CPUINFO_CASES))
def test_auto_decides_from_the_cpuinfo_it_reads(case, tmp_path, monkeypatch):
    """From /proc/cpuinfo text to the decision, with the expectation written out."""
    name, flag_line, policy, device = CPUINFO_CASES[case]
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: {name}\nflags\t\t: {flag_line}\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k),
    )
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    facts = _hardware.detect_device_facts.__wrapped__()  # uncached: reads the fake file
    decision = tfmp.recommend_policy(facts)
    assert (decision.policy, decision.device) == (policy, device)


def _this_cpu_flags():
    """The flags of this machine's CPU, read here independently of tfmp."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="decides for a GPU")
@pytest.mark.skipif(_this_cpu_flags() is None, reason="no /proc/cpuinfo to check against")
def test_this_cpu_machine():
    # The rule written out: hardware bfloat16 is AVX512_BF16 or AMX-BF16.
    has_bf16 = bool({"avx512_bf16", "amx_bf16"} & _this_cpu_flags())
    decision = tfmp.recommend_policy()
    assert decision.policy == ("mixed_bfloat16" if has_bf16 else "float32")
    assert decision.device.startswith("CPU '")
