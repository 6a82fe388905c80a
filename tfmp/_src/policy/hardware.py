"""Device facts that the automatic policy choice rests on.

GPUs and TPUs come from TensorFlow, the CPU from archspec (https://github.com/archspec/archspec),
read once per process. Tests and advisors pass a `DeviceFacts` instead, or make one this
machine's inside `injected_facts`, so every rule runs on any machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import threading
from typing import Any, Iterator, List, Optional, Tuple

from tfmp._src.errors import invalid_argument
from tfmp._src.report_fields import BOOL, COUNT, STRING, Kind, check_fields, instance_of, optional, tuple_of

#: CPU flags (as Linux's /proc/cpuinfo and archspec spell them) of hardware bfloat16 matmuls,
#: which oneDNN's bfloat16 kernels use: AVX512_BF16, AMX-BF16 (Intel Architecture Instruction
#: Set Extensions reference) and Arm FEAT_BF16 (Arm Architecture Reference Manual; HWCAP2_BF16).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
#: The environment variable TensorFlow reads to turn its oneDNN CPU kernels on or off.
ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
#: CPU flags with which TensorFlow's oneDNN kernels take float16 (x86; TensorFlow 2.21
#: ``tensorflow/core/util/util.cc``, ``IsDataTypeSupportedByOneDNNOnThisCPU(DT_HALF)``).
ONEDNN_FLOAT16_FLAGS = ("avx512_fp16", "amx_fp16", "avx_ne_convert")
#: x86 CPU flags with which TensorFlow turns oneDNN on by default on Linux (TensorFlow 2.21
#: ``tensorflow/core/util/port.cc``, ``DefaultOneDnnPolicy``).
ONEDNN_DEFAULT_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


_CAPABILITY = Kind("None or a tuple (major, minor) of two integers >= 0, e.g. (8, 0)",
                  lambda value: value is None or (tuple_of(COUNT).accepts(value) and len(value) == 2))
_FLAGS = Kind("a frozenset of lowercase flag strings, e.g. frozenset({'avx512_bf16'})",
              lambda value: isinstance(value, frozenset) and all(isinstance(f, str) for f in value))


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """One GPU as TensorFlow reports it.

    Attributes:
        name: String. Device name, e.g. ``"NVIDIA A100-SXM4-40GB"``.
        compute_capability: Tuple ``(major, minor)`` of ints, e.g. ``(8, 0)``;
            None when TensorFlow does not report it.

    Raises:
        ValueError: (template) `name` is not a string, or `compute_capability`
            not None or a tuple of two integers >= 0.
    """

    name: str
    compute_capability: Optional[Tuple[int, int]]

    def __post_init__(self) -> None:
        check_fields(self, name=STRING, compute_capability=_CAPABILITY)

    @property
    def cc_string(self) -> str:
        """String. ``"8.0"``-style compute capability, or ``"unknown"``."""
        return "unknown" if self.compute_capability is None else "%d.%d" % self.compute_capability


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What tfmp knows of this machine's accelerators and CPU.

    Attributes:
        gpus: Tuple of `GpuFacts`, empty on a machine without visible GPUs.
        tpu: Bool. True when TensorFlow lists a TPU device.
        cpu_name: String. CPU model name, e.g. ``"AMD EPYC"``.
        cpu_flags: Frozenset of lowercase CPU feature flags as Linux and
            archspec spell them, e.g. ``{"avx512f", "avx512_bf16"}`` (x86) or
            ``{"sve", "bf16"}`` (Arm).
        cpu_target: String. archspec's name of the CPU's microarchitecture, e.g.
            ``"zen4"``, ``"neoverse_v1"``, ``"m2"``; empty when unknown.
        system: String, as `platform.system()` says: ``"Linux"``, ``"Windows"``,
            ``"Darwin"`` (macOS).
        onednn_env: String or None. The value of ``TF_ENABLE_ONEDNN_OPTS``.

    Raises:
        ValueError: (template) a field of another type than the one above.

    Example:
        >>> a100 = DeviceFacts(gpus=(GpuFacts("NVIDIA A100", (8, 0)),))
        >>> a100.min_compute_capability
        (8, 0)
    """

    gpus: Tuple[GpuFacts, ...] = ()
    tpu: bool = False
    cpu_name: str = "unknown CPU"
    cpu_flags: frozenset = frozenset()
    cpu_target: str = ""
    system: str = "Linux"
    onednn_env: Optional[str] = None

    def __post_init__(self) -> None:
        check_fields(self, gpus=tuple_of(instance_of(GpuFacts, "a tfmp.GpuFacts")), tpu=BOOL,
                     cpu_name=STRING, cpu_flags=_FLAGS, cpu_target=STRING, system=STRING,
                     onednn_env=optional(STRING))

    @property
    def cpu_bf16_flags(self) -> Tuple[str, ...]:
        """Tuple of strings. The bfloat16 flags of `CPU_BF16_FLAGS` present."""
        return tuple(flag for flag in CPU_BF16_FLAGS if flag in self.cpu_flags)

    @property
    def onednn(self) -> bool:
        """Bool. TensorFlow's oneDNN CPU kernels are on, hence hardware bfloat16 matmuls.

        TensorFlow 2.21's rule (``tensorflow/core/util/port.cc``, ``IsMklEnabled`` and
        ``DefaultOneDnnPolicy``): ``TF_ENABLE_ONEDNN_OPTS`` decides when it is
        ``0``/``false``/``1``/``true`` (any case); otherwise oneDNN is on by default on
        Windows x86, on Linux for x86 CPUs with one of `ONEDNN_DEFAULT_FLAGS` and for
        Arm Neoverse V1 only.
        """
        value = (self.onednn_env or "").strip().lower()
        if value in ("1", "true", "0", "false"):
            return value in ("1", "true")
        x86 = bool(set(self.cpu_bf16_flags) - {"bf16"}) or "sse2" in self.cpu_flags
        if self.system == "Windows":
            return x86
        if self.system == "Linux":
            return (x86 and bool(set(ONEDNN_DEFAULT_FLAGS) & self.cpu_flags)) or self.cpu_target == "neoverse_v1"
        return False

    @property
    def onednn_bfloat16(self) -> bool:
        """Bool. TensorFlow's oneDNN kernels take bfloat16 on this CPU: oneDNN on, with
        AVX512F or AVX-NE-CONVERT (TensorFlow 2.21 ``tensorflow/core/util/util.cc``,
        ``IsDataTypeSupportedByOneDNNOnThisCPU(DT_BFLOAT16)``).
        """
        return self.onednn and bool({"avx512f", "avx_ne_convert"} & self.cpu_flags)

    @property
    def onednn_float16(self) -> bool:
        """Bool. TensorFlow's oneDNN kernels take float16 on this CPU (`ONEDNN_FLOAT16_FLAGS`).

        True with oneDNN on and AVX512BW plus AVX512_FP16 or AMX-FP16, or
        AVX-NE-CONVERT: where Grappler's fused float16 matmul is slow
        (`tfmp._src.policy.float16_fusion`).
        """
        flags = self.cpu_flags
        avx512 = "avx512bw" in flags and bool({"avx512_fp16", "amx_fp16"} & flags)
        return self.onednn and (avx512 or "avx_ne_convert" in flags)

    @property
    def weakest_gpu(self) -> Optional[GpuFacts]:
        """`GpuFacts` of the GPU with the lowest compute capability (an unknown one first), or None.

        The weakest GPU sets the pace of synchronous training, so the policy is chosen for it.
        """
        if not self.gpus:
            return None
        return min(self.gpus, key=lambda g: g.compute_capability or (-1, -1))

    @property
    def min_compute_capability(self) -> Optional[Tuple[int, int]]:
        """Tuple ``(major, minor)`` of `weakest_gpu`; None without GPUs or when unknown."""
        gpu = self.weakest_gpu
        return gpu.compute_capability if gpu is not None else None


def cpu_from_archspec(target: Any, detected: Any = None, brand: Optional[str] = None) -> Tuple[str, frozenset]:
    """Returns (CPU name, lowercase feature flags) from archspec's view of a CPU.

    The flags are the union of the target's and the `detected` ones read from the
    CPU: a target's list can lack what the CPU has (archspec 0.2.7 names a Cooper
    Lake ``cascadelake``), while an Apple CPU's read flags are empty. Without
    `brand` the CPU is named by vendor and microarchitecture.

    Example:
        >>> import archspec.cpu
        >>> name, flags = cpu_from_archspec(archspec.cpu.TARGETS["neoverse_v1"])
        >>> name, "bf16" in flags
        ('ARM neoverse_v1', True)
    """
    flags = set(target.features)
    if detected is not None:
        flags |= set(detected.features)
    name = brand or f"{target.vendor} {target.name}"
    return name, frozenset(flag.lower() for flag in flags)


def _read_gpus() -> Tuple[GpuFacts, ...]:
    import tensorflow as tf

    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(device)
        cc = details.get("compute_capability")
        gpus.append(GpuFacts(details.get("device_name", device.name), tuple(cc) if cc else None))
    return tuple(gpus)


_injected: List[DeviceFacts] = []
_injected_lock = threading.Lock()


def detect_device_facts() -> DeviceFacts:
    """This machine's `DeviceFacts`: the innermost `injected_facts`, else read once per process."""
    with _injected_lock:
        if _injected:
            return _injected[-1]
    return _read_device_facts()


@contextlib.contextmanager
def injected_facts(facts: DeviceFacts) -> Iterator[DeviceFacts]:
    """Makes `facts` this machine's inside the block, in every thread (tests; nested blocks allowed).

    Raises:
        ValueError: (template) `facts` is not a `DeviceFacts`.
    """
    if not isinstance(facts, DeviceFacts):
        raise invalid_argument("facts", facts, "a tfmp.DeviceFacts",
                               fix="Pass e.g. tfmp.DeviceFacts(cpu_name='CPU').")
    with _injected_lock:
        _injected.append(facts)
    try:
        yield facts
    finally:
        with _injected_lock:
            _injected.remove(facts)


@functools.lru_cache(maxsize=1)
def _read_device_facts() -> DeviceFacts:
    """Reads this machine's device facts (once per process: cached)."""
    import tensorflow as tf

    import archspec.cpu
    from archspec.cpu import detect

    cpu_name, cpu_flags = cpu_from_archspec(archspec.cpu.host(), detect.detected_info(), archspec.cpu.brand_string())
    return DeviceFacts(
        gpus=_read_gpus(),
        tpu=bool(tf.config.list_physical_devices("TPU")),
        cpu_name=cpu_name,
        cpu_flags=cpu_flags,
        cpu_target=archspec.cpu.host().name,
        system=platform.system(),
        onednn_env=os.environ.get(ONEDNN_ENV),
    )
