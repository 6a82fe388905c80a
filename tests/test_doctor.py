"""Tests for tfmp doctor: the report, the JSON output and the command line."""

import io
import json
import os
import re
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

import tfmp
import _tfmp_command as cli
from tfmp._src.policy import float16_fusion
from tfmp._src.policy.hardware import DeviceFacts, GpuFacts, detect_device_facts, injected_facts
from _machines import SAPPHIRE_RAPIDS, ZEN4
from test_onednn_isa import _expected_isa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where the messages' troubleshooting guide lies in this checkout (package data).
GUIDE = os.path.join(ROOT, "tfmp", "docs", "troubleshooting.md")
T4 = DeviceFacts(gpus=(GpuFacts("Tesla T4", (7, 5)),), cpu_name="Intel Xeon")
A100 = DeviceFacts(gpus=(GpuFacts("NVIDIA A100-SXM4-40GB", (8, 0)),), cpu_name="AMD EPYC")
P100 = DeviceFacts(gpus=(GpuFacts("Tesla P100-PCIE-16GB", (6, 0)),))
PLAIN_CPU = DeviceFacts(cpu_name="Intel Core i7-8700", cpu_flags=frozenset({"avx2"}))


def _gpu(report):
    return next(d for d in report.data["devices"] if d["type"] == "GPU")


@pytest.mark.parametrize(
    "facts, cc, policy, fp16, bf16, tf32",
    [
        (T4, "7.5", "mixed_float16", True, False, False),
        (A100, "8.0", "mixed_bfloat16", True, True, True),
        (P100, "6.0", "float32", False, False, False),
    ],
    ids=["T4", "A100", "P100"],
)
def test_injected_gpu_reports_compute_capability_and_recommendation(
        facts, cc, policy, fp16, bf16, tf32):
    out = io.StringIO()
    report = tfmp.doctor(facts, file=out)
    gpu = _gpu(report)
    assert (gpu["compute_capability"], gpu["float16"], gpu["bfloat16"], gpu["tf32"]) == (
        cc, fp16, bf16, tf32)
    rec = report.data["recommendation"]
    assert rec["policy"] == policy and cc in rec["reason"]
    assert rec["loss_scaling"] == (policy == "mixed_float16")
    assert report.data["facts"] == "injected"
    text = out.getvalue()
    assert f"compute capability {cc}" in text
    assert f"recommendation: {policy}" in text
    assert "No GPU visible" not in text


def test_this_machine_lists_the_devices_tensorflow_sees():
    report = tfmp.doctor(file=None)
    d = report.data
    assert d["facts"] == "detected"
    # Expected from TensorFlow's own device list, read here: a GPU machine lists its GPUs.
    gpus = len(tf.config.list_physical_devices("GPU"))
    tpu = bool(tf.config.list_physical_devices("TPU"))
    assert [dev["type"] for dev in d["devices"]] == ["CPU"] + ["GPU"] * gpus + ["TPU"] * tpu
    assert d["versions"]["tensorflow"] == tf.__version__
    assert d["versions"]["keras"] == keras.__version__
    assert d["build"]["cuda_build"] == bool(tf.sysconfig.get_build_info()["is_cuda_build"])
    no_accelerator = not gpus and not tpu
    assert any(n.startswith("No GPU visible") for n in d["notes"]) == no_accelerator
    assert ("  no GPU" in str(report).splitlines()) == (gpus == 0)


def test_cpu_bf16_flags_and_global_policy_are_reported():
    keras.config.set_dtype_policy("mixed_bfloat16")
    report = tfmp.doctor(PLAIN_CPU, file=None)
    cpu = report.data["devices"][0]
    assert cpu["bf16_flags"] == [] and cpu["bfloat16"] is False and cpu["float16"] is False
    assert report.data["global_policy"] == "mixed_bfloat16"
    assert report.data["recommendation"]["policy"] == "float32"
    assert any("#no-speed-up" in n for n in report.data["notes"])


def test_cpu_with_bf16_but_onednn_off_is_reported():
    mac = DeviceFacts(cpu_name="Apple M2", cpu_flags=frozenset({"bf16"}), cpu_target="m2",
                      system="Darwin")
    report = tfmp.doctor(mac, file=None)
    cpu = report.data["devices"][0]
    assert cpu["bf16_flags"] == ["bf16"] and cpu["onednn"] is False and cpu["bfloat16"] is False
    assert report.data["recommendation"]["policy"] == "float32"
    assert "CPU Apple M2 (bf16 flags: bf16; TensorFlow's oneDNN kernels off)" in str(report)


def test_unknown_compute_capability_is_not_guessed():
    facts = DeviceFacts(gpus=(GpuFacts("Mystery GPU", None),))
    report = tfmp.doctor(facts, file=None)
    gpu = _gpu(report)
    assert gpu["compute_capability"] == "unknown"
    assert gpu["float16"] is gpu["bfloat16"] is gpu["tf32"] is None
    assert "float16: unknown" in str(report)


def test_tf32_note_follows_the_switch():
    was_on = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        tf.config.experimental.enable_tensor_float_32_execution(True)
        on = tfmp.doctor(A100, file=None)
        tf.config.experimental.enable_tensor_float_32_execution(False)
        off = tfmp.doctor(A100, file=None)
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(was_on)
    assert on.data["tf32_enabled"] and not off.data["tf32_enabled"]
    assert any("TF32 is on" in n for n in on.data["notes"])
    assert not any("TF32 is on" in n for n in off.data["notes"])


def test_xla_autoclustering_on_a_bf16_cpu_is_flagged():
    bf16_cpu = DeviceFacts(cpu_name="AMD EPYC", cpu_flags=frozenset({"avx512_bf16"}))
    before = tf.config.optimizer.get_jit()
    try:
        tf.config.optimizer.set_jit("autoclustering")
        on = tfmp.doctor(bf16_cpu, file=None)
    finally:
        tf.config.optimizer.set_jit(before or False)
    off = tfmp.doctor(bf16_cpu, file=None)
    assert on.data["xla"]["auto_jit"] == "autoclustering"
    assert any("XLA" in n and "#no-speed-up" in n for n in on.data["notes"])
    assert off.data["xla"]["auto_jit"] == "off"
    assert not any("XLA" in n for n in off.data["notes"])


def test_json_output_round_trips():
    out = io.StringIO()
    report = tfmp.doctor(T4, as_json=True, file=out)
    assert json.loads(out.getvalue()) == report.to_dict()


def test_cli_entry_function(capsys):
    assert cli.main(["doctor", "--json"], device_facts=A100) == 0
    data = json.loads(capsys.readouterr().out)
    assert _gpu_from(data)["compute_capability"] == "8.0"
    assert cli.main(["doctor"]) == 0
    assert capsys.readouterr().out.startswith("tfmp doctor")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2


def _gpu_from(data):
    return next(d for d in data["devices"] if d["type"] == "GPU")


def test_python_dash_m_tfmp_doctor_json():
    """One subprocess (importing TensorFlow takes seconds); text mode is tested above."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-m", "tfmp", "doctor", "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(done.stdout)
    assert data["facts"] == "detected"
    assert data["recommendation"]["policy"] in ("float32", "mixed_bfloat16")


def _slug(heading):
    text = "".join(c for c in heading.lower() if c.isalnum() or c in " -")
    return text.strip().replace(" ", "-")


def test_troubleshooting_links_point_to_existing_sections():
    with open(GUIDE, encoding="utf-8") as f:
        doc = f.read()
    sections = {_slug(line[3:]) for line in doc.splitlines() if line.startswith("## ")}
    assert {"nan-or-inf-loss", "gradients-stuck-at-zero", "no-speed-up",
            "no-memory-saving", "accuracy-drop-versus-float32"} <= sections
    linked = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "tfmp")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    linked |= set(re.findall(
                        r"(?:troubleshooting\.md|\{TROUBLESHOOTING_GUIDE\})#([\w-]+)", f.read()))
    assert {"no-speed-up", "no-memory-saving", "accuracy-drop-versus-float32"} <= linked
    anchors = linked | set(re.findall(r"\]\(#([\w-]+)\)", doc))
    assert anchors <= sections, sorted(anchors - sections)


def test_report_names_the_troubleshooting_guide_of_this_installation():
    """The package's own copy (package data), here the checkout's file."""
    report = tfmp.doctor(T4, file=None)
    assert report.data["troubleshooting"] == GUIDE
    assert f"troubleshooting guide: {GUIDE}" in str(report).splitlines()
    assert os.path.isfile(GUIDE)


# Only what applies to the devices present; the CPU's measured step -------------------

BF16_CPU = DeviceFacts(cpu_name="Intel Xeon Platinum 8480+",
                       cpu_flags=frozenset({"avx512_bf16", "amx_bf16", "avx512_fp16"}))
PROBE = tfmp.SpeedProbe(float32_ms=2.0, bfloat16_ms=1.0, float16_ms=200.0,
                        repeats=(5, 5, 0), wall_ms=640.0)


@pytest.mark.parametrize("facts", [PLAIN_CPU, BF16_CPU], ids=["plain", "bf16"])
def test_cpu_only_text_has_no_tf32_and_no_cuda_build(facts):
    text = str(tfmp.doctor(facts, file=None))
    assert "TF32" not in text
    cuda_lines = [line for line in text.splitlines() if "CUDA" in line]
    # The one place CUDA is named: the note on a CUDA build without a visible GPU.
    assert all(line.startswith("  - No GPU visible: TensorFlow runs on the CPU.")
               for line in cuda_lines)
    assert len(cuda_lines) == int(bool(tf.sysconfig.get_build_info().get("is_cuda_build")))
    assert not any(line.startswith("  build:") for line in text.splitlines())


def test_gpu_text_still_shows_tf32_and_the_build():
    lines = str(tfmp.doctor(A100, file=None)).splitlines()
    assert "      float16: yes   bfloat16: yes   TF32: yes" in lines
    assert any(line.startswith("TF32 execution: ") for line in lines)
    assert any(line.startswith("  build:     ") for line in lines)


def test_json_keys_are_stable_and_the_probe_is_none_for_injected_facts():
    data = tfmp.doctor(PLAIN_CPU, file=None).to_dict()
    assert set(data) == {"versions", "build", "devices", "tf32_enabled", "xla",
                         "global_policy", "recommendation", "facts", "speed_probe",
                         "onednn_isa", "troubleshooting", "notes"}
    assert data["speed_probe"] is None and data["devices"][0]["tf32"] is None
    assert data["onednn_isa"] is None  # another machine's: not read from this one
    text = str(tfmp.doctor(PLAIN_CPU, file=None))
    assert "training step" not in text and "oneDNN matmul ISA" not in text


def test_an_injected_probe_is_printed_and_quoted():
    report = tfmp.doctor(BF16_CPU, speed_probe=PROBE, file=None)
    assert report.data["speed_probe"] == {**PROBE.to_dict(), "float16_remapper": None}
    lines = str(report).splitlines()
    at = lines.index("      float16: no   bfloat16: yes")
    assert lines[at + 1:at + 3] == [
        "      training step (MatMul 128x256 @ 256x256 + bias + ReLU, forward and backward, "
        "probe 0.64 s):",
        "        float32 2.00 ms; bfloat16 1.00 ms (2.0x); float16 200 ms (0.01x)",
    ]
    assert "measured here: a bfloat16 training step runs 2.0x float32's speed" in (
        report.data["recommendation"]["reason"])


def test_global_float16_note_quotes_the_probe():
    keras.config.set_dtype_policy("mixed_float16")
    report = tfmp.doctor(BF16_CPU, speed_probe=PROBE, file=None)
    [note] = [n for n in report.data["notes"] if n.startswith("The global policy 'mixed_float16'")]
    assert "a float16 training step measured 0.01x float32's speed on this CPU" in note
    assert "TensorFlow has no fast float16 CPU kernels for training" in note
    assert "no float16 arithmetic" not in note


def test_this_machine_reports_its_probe_when_the_cpu_decides():
    report = tfmp.doctor(file=None)
    probe = report.data["speed_probe"]
    if tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU"):
        assert probe is None
        return
    assert probe["factor"]["float32"] == 1.0
    assert all(ms > 0 for ms in probe["step_ms"].values())
    assert "      training step (MatMul 128x256 @ 256x256" in str(report)
    # three rounds, each factor with its spread; the recommendation is "auto"'s, from the facts
    assert set(probe["factor_range"]) == {"float32", "bfloat16", "float16"}
    low, high = probe["factor_range"]["bfloat16"]
    assert 0 < low <= high and "-" in str(report).split("bfloat16 ", 2)[-1]
    assert "3 rounds" in str(report)
    assert report.data["recommendation"]["policy"] == tfmp.recommend_policy().policy
    # float16 timed on tfmp's path: the remapper off only where its trap is (not on this CPU's facts)
    trap = float16_fusion.remapper_trap("float16", detect_device_facts()) is not None
    assert probe["float16_remapper"] == ("off" if trap else "on")
    # oneDNN's ISA, read in a child: the default oneDNN setting of this process
    isa = report.data["onednn_isa"]
    assert isa["source"] == "measured" and isa["isa"] == _expected_isa(detect_device_facts())
    assert f"      oneDNN matmul ISA: {isa['label']}" in str(report)


TRAP_CPU = DeviceFacts(cpu_name="Intel Xeon 6", cpu_flags=frozenset(
    {"avx512f", "avx512bw", "avx512_fp16", "avx512_bf16", "amx_bf16"}))


def test_float16_is_timed_on_the_path_tfmp_takes(monkeypatch):
    """Where the fused float16 matmul is a trap, tfmp runs float16 without the remapper: so does the probe."""
    from tfmp._src.advisors import doctor as doctor_module

    asked = []
    monkeypatch.setattr(doctor_module, "measure_rounds",
                        lambda **how: asked.append(how["float16_unfused"]) or PROBE)
    with injected_facts(TRAP_CPU):
        report = tfmp.doctor(file=None)
    assert asked == [True] and report.data["speed_probe"]["float16_remapper"] == "off"
    assert "float16 200 ms (0.01x) (remapper off, as tfmp runs float16 here)" in str(report)


def test_a_slow_probe_never_changes_the_recommendation():
    slow = tfmp.SpeedProbe(float32_ms=1.0, bfloat16_ms=4.0, float16_ms=200.0)
    report = tfmp.doctor(BF16_CPU, speed_probe=slow, file=None)
    assert report.data["recommendation"]["policy"] == "mixed_bfloat16"
    assert "pin float32 with tfmp.enable('float32')" in report.data["recommendation"]["reason"]


@pytest.mark.parametrize("low, high, text", [
    (1.08, 1.13, "1.08-1.13x"), (0.82, 0.9, "0.82-0.90x"), (1.1034, 1.1041, "1.103-1.104x"),
    (0.0012, 0.0015, "0.0012-0.0015x"), (1.1, 1.1, "1.10-1.10x"),
])
def test_a_spread_prints_both_ends_with_the_same_decimals(low, high, text):
    from tfmp._src.advisors.doctor import _span

    assert _span(low, high) == text


def test_a_cpu_whose_onednn_takes_float16_says_so_beside_its_float16_verdict():
    """float16 is still "no" (slower than float32) there, but not for want of kernels."""
    report = tfmp.doctor(SAPPHIRE_RAPIDS, file=None)
    [cpu] = report.data["devices"]
    assert cpu["onednn_float16"] is True and cpu["float16"] is False
    assert "      float16: no (oneDNN takes it, slower than float32)   bfloat16: yes" in str(report).splitlines()
    report = tfmp.doctor(ZEN4, file=None)
    assert report.data["devices"][0]["onednn_float16"] is False
    assert "      float16: no   bfloat16: yes" in str(report).splitlines()


def test_the_device_list_says_what_its_yes_and_no_answer():
    lines = str(tfmp.doctor(ZEN4, file=None)).splitlines()
    assert "devices (injected; float16/bfloat16: does that mixed policy train faster than float32):" in lines
