"""`tfmp doctor`: what this machine offers for mixed precision, in one report.

What practitioners otherwise check by hand: versions, whether each device runs float16,
bfloat16 and TF32 in hardware, the ISA oneDNN runs matmuls with, the CPU's timed step, XLA,
the global policy and what "auto" would pick. Facts can be injected to report on another machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import sys
from typing import Any, Dict, List, Optional, TextIO

import keras
import tensorflow as tf

from tfmp._src.constants import TROUBLESHOOTING_GUIDE
from tfmp._src.errors import check_bool, invalid_argument
from tfmp._src.policy import float16_fusion, onednn_isa
from tfmp._src.policy.hardware import DeviceFacts, GpuFacts
from tfmp._src.policy.policy import _facts_and_probe, recommend_policy, slower_than_float32
from tfmp._src.policy.speed_probe import DTYPES, SpeedProbe, format_factor, format_ms, measure_rounds, ROUNDS
from tfmp._src.report_fields import Kind, check_fields
from tfmp._version import __version__

_YES = {True: "yes", False: "no", None: "n/a"}
_REPORT_KEYS = ("versions", "build", "devices", "tf32_enabled", "xla", "global_policy",
                "recommendation", "facts", "speed_probe", "onednn_isa", "troubleshooting", "notes")
_REPORT_DATA = Kind("a dict with the keys " + ", ".join(_REPORT_KEYS),
                    lambda data: isinstance(data, dict) and set(_REPORT_KEYS) <= set(data))


def _gpu_entry(index: int, gpu: GpuFacts) -> Dict[str, Any]:
    """The GPU's line of the device list, judged as if it were the only device."""
    alone = DeviceFacts(gpus=(gpu,))
    known = gpu.compute_capability is not None
    return {
        "type": "GPU",
        "index": index,
        "name": gpu.name,
        "compute_capability": gpu.cc_string,
        # None from slower_than_float32: the 16-bit compute runs in hardware.
        "float16": slower_than_float32("mixed_float16", alone) is None if known else None,
        "bfloat16": slower_than_float32("mixed_bfloat16", alone) is None if known else None,
        "tf32": recommend_policy(alone).tf32 if known else None,
    }


def _cpu_entry(facts: DeviceFacts, probe: Optional[SpeedProbe]) -> Dict[str, Any]:
    cpu = dataclasses.replace(facts, gpus=(), tpu=False)
    return {
        "type": "CPU",
        "name": facts.cpu_name,
        "bf16_flags": list(facts.cpu_bf16_flags),
        "onednn": facts.onednn,
        "onednn_float16": facts.onednn_float16,
        "float16": False,
        "bfloat16": slower_than_float32("mixed_bfloat16", cpu, probe) is None,
        "tf32": None,
    }


def _notes(data: Dict[str, Any], facts: DeviceFacts,
           probe: Optional[SpeedProbe]) -> List[str]:
    """Plain-language remarks on what the report shows, each with a fix."""
    notes, rec, build = [], data["recommendation"], data["build"]
    if not facts.gpus and not facts.tpu:
        text = "No GPU visible: TensorFlow runs on the CPU."
        if build["cuda_build"]:
            text += (f" This TensorFlow is built with CUDA {build['cuda_version']}; if the "
                     "machine has an NVIDIA GPU, check the driver (nvidia-smi) and the CUDA "
                     "libraries (pip install 'tensorflow[and-cuda]').")
        notes.append(text)
    current = data["global_policy"]
    if current != rec["policy"]:
        notes.append(f"The global policy is {current!r}; tfmp.enable() would set "
                     f"{rec['policy']!r}.")
    if current in ("mixed_float16", "mixed_bfloat16", "float16", "bfloat16"):
        slow = slower_than_float32(current, facts, probe)
        if slow:
            notes.append(f"The global policy {current!r} is slower than float32 here: "
                         f"{slow}. See {TROUBLESHOOTING_GUIDE}#no-speed-up")
    if data["tf32_enabled"] and any(d.get("tf32") for d in data["devices"]):
        notes.append("TF32 is on: float32 matmuls on compute capability >= 8.0 keep only "
                     "10 mantissa bits. For full float32 precision call "
                     "tf.config.experimental.enable_tensor_float_32_execution(False).")
    cpu_bf16 = not facts.gpus and rec["compute_dtype"] == "bfloat16"
    if data["xla"]["auto_jit"] != "off" and cpu_bf16:
        notes.append("XLA auto-clustering is on for a CPU with bfloat16: XLA's CPU matmuls "
                     "do not use the bfloat16 units, so bfloat16 gains nothing there. "
                     f"See {TROUBLESHOOTING_GUIDE}#no-speed-up")
    return notes


def _device_name(dev: Dict[str, Any]) -> str:
    if dev["type"] == "GPU":
        return (f"GPU:{dev['index']} {dev['name']}, compute capability "
                f"{dev['compute_capability']}")
    if dev["type"] == "CPU":
        onednn = "on" if dev["onednn"] else "off"
        return (f"CPU {dev['name']} (bf16 flags: {', '.join(dev['bf16_flags']) or 'none'}; "
                f"TensorFlow's oneDNN kernels {onednn})")
    return dev["name"]


def _span(low: float, high: float) -> str:
    """``"1.08-1.13x"``: two factors with the same decimals, more where they would read alike."""
    decimals = max(2, 1 - math.floor(math.log10(low)))
    while decimals < 6 and round(low, decimals) == round(high, decimals) and low != high:
        decimals += 1
    return f"{low:.{decimals}f}-{high:.{decimals}f}x"


def _probe_lines(probe: Dict[str, Any]) -> List[str]:
    """The CPU's measured step (`SpeedProbe.to_dict`, and doctor's ``float16_remapper``), as two lines of the device list."""
    ranges = probe.get("factor_range")

    def factor(dtype: str) -> str:
        text = f"{format_factor(probe['factor'][dtype])}x"
        if ranges:
            low, high = ranges[dtype]
            text += f", {_span(low, high)} over {ROUNDS} rounds"
        return f" ({text})"

    times = "; ".join(
        f"{dtype} {format_ms(probe['step_ms'][dtype])} ms"
        + ("" if dtype == "float32" else factor(dtype))
        for dtype in DTYPES)
    if probe.get("float16_remapper") == "off":
        times += " (remapper off, as tfmp runs float16 here)"
    size = f"{probe['batch']}x{probe['units']} @ {probe['units']}x{probe['units']}"
    rounds = f"{ROUNDS} rounds" if ranges else "probe"
    took = f", {rounds} {probe['wall_ms'] / 1e3:.2f} s" if probe["wall_ms"] is not None else ""
    return [f"      training step (MatMul {size} + bias + ReLU, forward and backward{took}):",
            f"        {times}"]


def _isa_text(isa: Dict[str, Any]) -> str:
    """The ``onednn_isa`` entry (`OneDnnIsa.to_dict`) as one line's text."""
    if isa["source"] != "measured":
        return f"unknown ({isa['source']})"
    if isa["isa"] == "off":
        return "none: oneDNN printed nothing for TensorFlow's matmuls (oneDNN off)"
    matmuls = ", ".join(f"{dtype} {impl}" for dtype, impl in isa["matmuls"].items())
    said = "; ".join(filter(None, [f"oneDNN: {isa['cpu_isa']}" if isa["cpu_isa"] else "", matmuls]))
    return f"{isa['label']} ({said})" if said else isa["label"]


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """The facts `doctor` gathered.

    Attributes:
        data: Dict, JSON-serializable. Keys: ``versions``, ``build``, ``devices``
            (list of dicts with ``type``, ``name``, ``compute_capability`` for GPUs,
            and ``float16``/``bfloat16``/``tf32``: True, False, or None for unknown
            or not applicable, whether that mixed policy is faster than float32
            there; the CPU's also ``bf16_flags``, ``onednn`` and
            ``onednn_float16``, TensorFlow's oneDNN takes float16), ``tf32_enabled``, ``xla``, ``global_policy``,
            ``recommendation`` (``policy``, ``reason``, ``device``, ``tf32``,
            ``compute_dtype``, ``loss_scaling``), ``facts`` (``"detected"`` or
            ``"injected"``), ``speed_probe`` (`SpeedProbe.to_dict` of the CPU's
            measured step, plus ``float16_remapper``: ``"off"`` where float16 was
            timed without Grappler's remapper as tfmp runs it, ``"on"``, or None
            for a given probe; None when `doctor` neither got nor measured one),
            ``onednn_isa`` (`OneDnnIsa.to_dict` of
            `tfmp._src.policy.onednn_isa`: ``isa``, ``label``, ``cpu_isa``,
            ``matmuls``, ``source``; None for injected facts), ``troubleshooting`` (the guide's path) and ``notes`` (list of strings).

    Raises:
        ValueError: (template) `data` is not a dict with (at least) the keys above.
    """

    data: Dict[str, Any]

    def __post_init__(self) -> None:
        check_fields(self, data=_REPORT_DATA)

    def to_dict(self) -> Dict[str, Any]:
        """Returns a deep copy of `data`."""
        return json.loads(self.to_json())

    def to_json(self, indent: Optional[int] = 2) -> str:
        """Returns `data` as a JSON string."""
        return json.dumps(self.data, indent=indent)

    def __str__(self) -> str:
        d = self.data
        v, b, rec = d["versions"], d["build"], d["recommendation"]
        gpus = any(dev["type"] == "GPU" for dev in d["devices"])
        lines = [
            "tfmp doctor",
            f"  versions:  tfmp {v['tfmp']}, TensorFlow {v['tensorflow']}, "
            f"Keras {v['keras']}, Python {v['python']}",
        ]
        if gpus:
            cuda = (f"CUDA {b['cuda_version']}, cuDNN {b['cudnn_version']}, compiled for "
                    f"{', '.join(b['cuda_compute_capabilities']) or '-'}"
                    if b["cuda_build"] else "no CUDA")
            lines.append(f"  build:     {cuda}; ROCm {_YES[b['rocm_build']]}; "
                         f"TensorRT {_YES[b['tensorrt_build']]}")
        lines.append(f"devices ({d['facts']}; float16/bfloat16: does that mixed policy train faster than float32):")
        for dev in d["devices"]:
            word = {**_YES, None: "unknown" if dev["type"] == "GPU" else "n/a"}
            float16 = word[dev["float16"]] + (" (oneDNN takes it, slower than float32)"
                                              if dev.get("onednn_float16") else "")
            support = f"float16: {float16}   bfloat16: {word[dev['bfloat16']]}"
            if dev["type"] == "GPU":
                support += f"   TF32: {word[dev['tf32']]}"
            lines += [f"  {_device_name(dev)}", f"      {support}"]
            if dev["type"] == "CPU" and d["onednn_isa"] is not None:
                lines.append(f"      oneDNN matmul ISA: {_isa_text(d['onednn_isa'])}")
            if dev["type"] == "CPU" and d["speed_probe"] is not None:
                lines += _probe_lines(d["speed_probe"])
        if not gpus:
            lines.append("  no GPU")
        else:
            lines.append(f"TF32 execution: {'on' if d['tf32_enabled'] else 'off'} "
                         "(takes effect on compute capability >= 8.0 only)")
        lines += [
            f"XLA: {'built in' if d['xla']['built_with_xla'] else 'not built'}; "
            f"auto-clustering {d['xla']['auto_jit']}",
            f"global policy: {d['global_policy']}",
            f"recommendation: {rec['policy']} for {rec['device']}",
            f"  {rec['reason']}"
            + (" Needs dynamic loss scaling." if rec["loss_scaling"] else ""),
            f"troubleshooting guide: {d['troubleshooting']}",
        ]
        if d["notes"]:
            lines += ["notes:"] + [f"  - {n}" for n in d["notes"]]
        return "\n".join(lines)


def doctor(
    device_facts: Optional[DeviceFacts] = None,
    *,
    speed_probe: Optional[SpeedProbe] = None,
    as_json: bool = False,
    file: Optional[TextIO] = sys.stdout,
) -> DoctorReport:
    """Prints and returns what this machine offers for mixed precision.

    Args:
        device_facts: `DeviceFacts` or None. Devices to report on; None detects this
            machine's. Versions, build and settings always come from this process.
        speed_probe: `SpeedProbe` or None. The CPU's measured step, quoted, never
            deciding the recommendation; None measures this CPU (`speed_probe.ROUNDS` rounds,
            about a second) when `device_facts` is None and there is no GPU or TPU.
            float16 is timed as tfmp runs it: without Grappler's remapper where
            `float16_fusion.remapper_trap` holds.
        as_json: Bool. Print JSON instead of text.
        file: Writable text stream or None (do not print). Default stdout.

    With `device_facts` None, the ISA oneDNN runs TensorFlow's matmuls with is read
    from a child process (`onednn_isa.detect`: about a second, once per process).

    Returns:
        `DoctorReport`; ``report.to_dict()`` for programs.

    Raises:
        ValueError: (template, before anything is gathered) `device_facts` neither
            None nor a `DeviceFacts`; `speed_probe` neither None nor a `SpeedProbe`;
            `as_json` not True or False; `file` neither None nor an open stream
            with a ``write`` method.

    Example:
        >>> from tfmp._src.policy.hardware import DeviceFacts, GpuFacts
        >>> t4 = DeviceFacts(gpus=(GpuFacts("Tesla T4", (7, 5)),))
        >>> doctor(t4, file=None).data["recommendation"]["policy"]
        'mixed_float16'
    """
    check_bool("as_json", as_json)
    if file is not None and (not callable(getattr(file, "write", None)) or getattr(file, "closed", False) is True):
        raise invalid_argument(
            "file", file, "None or an open, writable text stream (with a write method)",
            fix="Pass e.g. file=sys.stdout or an open(path, 'w') file; to write to a path, "
            "open it first.")
    facts, probe = _facts_and_probe(device_facts, speed_probe)  # checks both
    isa = onednn_isa.detect() if device_facts is None else None  # before the probe, not beside it
    remapper = None
    if probe is None and device_facts is None and not facts.gpus and not facts.tpu:
        unfused = float16_fusion.remapper_trap("float16", facts) is not None
        probe = measure_rounds(float16_unfused=unfused)
        remapper = "off" if unfused else "on"
    info = dict(tf.sysconfig.get_build_info())
    decision = recommend_policy(facts, speed_probe=probe)
    devices = [_cpu_entry(facts, probe)]
    devices += [_gpu_entry(i, g) for i, g in enumerate(facts.gpus)]
    if facts.tpu:
        devices.append({"type": "TPU", "name": "TPU", "float16": False,
                        "bfloat16": True, "tf32": None})
    data: Dict[str, Any] = {
        "versions": {"tfmp": __version__, "tensorflow": tf.__version__,
                     "keras": keras.__version__, "python": platform.python_version()},
        "build": {
            "cuda_build": bool(info.get("is_cuda_build", False)),
            "cuda_version": info.get("cuda_version"),
            "cudnn_version": info.get("cudnn_version"),
            "cuda_compute_capabilities": list(info.get("cuda_compute_capabilities", [])),
            "rocm_build": bool(info.get("is_rocm_build", False)),
            "tensorrt_build": bool(info.get("is_tensorrt_build", False)),
        },
        "devices": devices,
        "tf32_enabled": bool(tf.config.experimental.tensor_float_32_execution_enabled()),
        "xla": {"built_with_xla": bool(tf.test.is_built_with_xla()),
                "auto_jit": tf.config.optimizer.get_jit() or "off"},
        "global_policy": keras.config.dtype_policy().name,
        "recommendation": {
            "policy": decision.policy, "reason": decision.reason,
            "device": decision.device, "tf32": decision.tf32,
            "compute_dtype": decision.compute_dtype,
            "loss_scaling": decision.loss_scaling,
        },
        "facts": "detected" if device_facts is None else "injected",
        "speed_probe": ({**probe.to_dict(), "float16_remapper": remapper}
                        if probe is not None else None),
        "onednn_isa": isa.to_dict() if isa is not None else None,
        "troubleshooting": TROUBLESHOOTING_GUIDE,
    }
    data["notes"] = _notes(data, facts, probe)
    report = DoctorReport(data)
    if file is not None:
        print(report.to_json() if as_json else str(report), file=file)
    return report
