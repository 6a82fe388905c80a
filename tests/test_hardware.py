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
    assert {"avx512f", "avx512_bf16"} <= flags
    assert tfmp.DeviceFacts(cpu_flags=flags).cpu_bf16_flags == ("avx512_bf16",)


def _this_cpu_has_bf16():
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return False
    return any(flag in text.split() for flag in _hardware.CPU_BF16_FLAGS)


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="decides for a GPU")
def test_this_cpu_machine():
    decision = tfmp.recommend_policy()
    expected = "mixed_bfloat16" if _this_cpu_has_bf16() else "float32"
    assert decision.policy == expected
    assert decision.device.startswith("CPU")
