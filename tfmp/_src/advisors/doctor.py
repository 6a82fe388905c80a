"""`tfmp doctor`: what this machine offers for mixed precision, in one report.

Gathers what practitioners otherwise check by hand (nvidia-smi, nvcc, listing
devices): TensorFlow and Keras versions, the CUDA/cuDNN build
(`tf.sysconfig.get_build_info()`), each device with its compute capability and
whether it runs float16, bfloat16 and TF32 in hardware, whether TF32 is switched
on, XLA, the CPU's bfloat16 flags, the current global policy, and the policy "auto"
would pick with its reason. Device facts can be injected (`DeviceFacts`), so the
report can be produced for a GPU this machine does not have.

Per-device support follows the same rules as "auto" (`tfmp._src.policy.policy`): float16
Tensor Cores from compute capability 7.0, bfloat16 Tensor Cores and TF32 from 8.0;
on a CPU, bfloat16 with AVX512_BF16, AMX-BF16 or Arm BF16 and float16 never.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
from typing import Any, Dict, List, Optional, TextIO

import keras
import tensorflow as tf

from tfmp._src.constants import TROUBLESHOOTING_GUIDE
from tfmp._src.policy.hardware import DeviceFacts, GpuFacts, detect_device_facts
from tfmp._src.policy.policy import recommend_policy, slower_than_float32
from tfmp._version import __version__

_YES = {True: "yes", False: "no", None: "n/a"}


def _fast(policy: str, facts: DeviceFacts) -> bool:
    """True when `policy`'s 16-bit compute runs in hardware on `facts`."""
    return slower_than_float32(policy, facts) is None


def _gpu_entry(index: int, gpu: GpuFacts) -> Dict[str, Any]:
    alone = DeviceFacts(gpus=(gpu,))
    known = gpu.compute_capability is not None
    return {
        "type": "GPU",
        "index": index,
        "name": gpu.name,
        "compute_capability": gpu.cc_string,
        "float16": _fast("mixed_float16", alone) if known else None,
        "bfloat16": _fast("mixed_bfloat16", alone) if known else None,
        "tf32": recommend_policy(alone).tf32 if known else None,
    }


def _cpu_entry(facts: DeviceFacts) -> Dict[str, Any]:
    cpu = dataclasses.replace(facts, gpus=(), tpu=False)
    return {
        "type": "CPU",
        "name": facts.cpu_name,
        "bf16_flags": list(facts.cpu_bf16_flags),
        "onednn": facts.onednn,
        "float16": False,
        "bfloat16": _fast("mixed_bfloat16", cpu),
        "tf32": None,
    }


def _notes(data: Dict[str, Any], facts: DeviceFacts) -> List[str]:
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
        slow = slower_than_float32(current, facts)
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
                     "do not use the bfloat16 units (measured 0.94x float32 instead of "
                     f"2.0x). See {TROUBLESHOOTING_GUIDE}#no-speed-up")
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


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """The facts `doctor` gathered.

    Attributes:
        data: Dict, JSON-serializable. Keys: ``versions``, ``build``, ``devices``
            (list of dicts with ``type``, ``name``, ``compute_capability`` for GPUs,
            and ``float16``/``bfloat16``/``tf32``: True, False, or None for unknown
            or not applicable), ``tf32_enabled``, ``xla``, ``global_policy``,
            ``recommendation`` (``policy``, ``reason``, ``device``, ``tf32``,
            ``compute_dtype``, ``loss_scaling``), ``facts`` (``"detected"`` or
            ``"injected"``), ``troubleshooting`` (string: the path of the
            troubleshooting guide in this installation) and ``notes`` (list of
            strings).
    """

    data: Dict[str, Any]

    def to_dict(self) -> Dict[str, Any]:
        """Returns a deep copy of `data`."""
        return json.loads(self.to_json())

    def to_json(self, indent: Optional[int] = 2) -> str:
        """Returns `data` as a JSON string."""
        return json.dumps(self.data, indent=indent)

    def __str__(self) -> str:
        d = self.data
        v, b, rec = d["versions"], d["build"], d["recommendation"]
        cuda = (f"CUDA {b['cuda_version']}, cuDNN {b['cudnn_version']}, compiled for "
                f"{', '.join(b['cuda_compute_capabilities']) or '-'}"
                if b["cuda_build"] else "no CUDA")
        lines = [
            "tfmp doctor",
            f"  versions:  tfmp {v['tfmp']}, TensorFlow {v['tensorflow']}, "
            f"Keras {v['keras']}, Python {v['python']}",
            f"  build:     {cuda}; ROCm {_YES[b['rocm_build']]}; "
            f"TensorRT {_YES[b['tensorrt_build']]}",
            f"devices ({d['facts']}):",
        ]
        for dev in d["devices"]:
            word = {**_YES, None: "unknown" if dev["type"] == "GPU" else "n/a"}
            lines += [f"  {_device_name(dev)}",
                      f"      float16: {word[dev['float16']]}   bfloat16: "
                      f"{word[dev['bfloat16']]}   TF32: {word[dev['tf32']]}"]
        if not any(dev["type"] == "GPU" for dev in d["devices"]):
            lines.append("  no GPU")
        lines += [
            f"TF32 execution: {'on' if d['tf32_enabled'] else 'off'} "
            "(takes effect on compute capability >= 8.0 only)",
            f"XLA: {'built in' if d['xla']['built_with_xla'] else 'not built'}; "
            f"auto-clustering {d['xla']['auto_jit']}",
            f"global policy: {d['global_policy']}",
            f"recommendation: {rec['policy']} for {rec['device']}",
            f"  {rec['reason']}"
            + (" Needs dynamic loss scaling." if rec["loss_scaling"] else ""),
        ]
        lines.append(f"troubleshooting guide: {d['troubleshooting']}")
        if d["notes"]:
            lines += ["notes:"] + [f"  - {n}" for n in d["notes"]]
        return "\n".join(lines)


def collect(device_facts: Optional[DeviceFacts] = None) -> DoctorReport:
    """Gathers the report without printing it.

    Args:
        device_facts: `DeviceFacts` or None. Devices to report on; None detects
            this machine's. Versions, build and settings always come from this
            process.

    Returns:
        `DoctorReport`.
    """
    facts = device_facts if device_facts is not None else detect_device_facts()
    info = dict(tf.sysconfig.get_build_info())
    decision = recommend_policy(facts)
    devices = [_cpu_entry(facts)]
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
        "troubleshooting": TROUBLESHOOTING_GUIDE,
    }
    data["notes"] = _notes(data, facts)
    return DoctorReport(data)


def doctor(
    device_facts: Optional[DeviceFacts] = None,
    *,
    as_json: bool = False,
    file: Optional[TextIO] = sys.stdout,
) -> DoctorReport:
    """Prints and returns what this machine offers for mixed precision.

    Args:
        device_facts: `DeviceFacts` or None (detect this machine's devices).
        as_json: Bool. Print JSON instead of text.
        file: Writable text stream or None (do not print). Default stdout.

    Returns:
        `DoctorReport`; ``report.to_dict()`` for programs.

    Example:
        >>> from tfmp._src.policy.hardware import DeviceFacts, GpuFacts
        >>> t4 = DeviceFacts(gpus=(GpuFacts("Tesla T4", (7, 5)),))
        >>> doctor(t4, file=None).data["recommendation"]["policy"]
        'mixed_float16'
    """
    report = collect(device_facts)
    if file is not None:
        print(report.to_json() if as_json else str(report), file=file)
    return report
