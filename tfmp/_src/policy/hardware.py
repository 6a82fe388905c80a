"""Device facts that the automatic policy choice rests on.

Facts come from TensorFlow (`tf.config.list_physical_devices`,
`tf.config.experimental.get_device_details` for a GPU's compute capability) and
from the CPU's feature flags (`/proc/cpuinfo` on Linux). Detection runs once per
process (cached); tests and advisors inject a `DeviceFacts` instead, so every
rule can be exercised without the hardware.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from typing import Optional, Tuple

# CPU flags (as Linux spells them in /proc/cpuinfo) that give hardware bfloat16
# matmuls: AVX512_BF16 (Intel Cooper Lake+, AMD Zen 4+) and AMX-BF16 (Intel
# Sapphire Rapids+). Source: Intel and AMD instruction-set references; oneDNN
# uses them for its bfloat16 kernels.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """One GPU as TensorFlow reports it.

    Attributes:
        name: String. Device name, e.g. ``"NVIDIA A100-SXM4-40GB"``.
        compute_capability: Tuple ``(major, minor)`` of ints, e.g. ``(8, 0)``;
            None when TensorFlow does not report it.
    """

    name: str
    compute_capability: Optional[Tuple[int, int]]

    @property
    def cc_string(self) -> str:
        """String. ``"8.0"``-style compute capability, or ``"unknown"``."""
        if self.compute_capability is None:
            return "unknown"
        return "%d.%d" % self.compute_capability


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What tfmp knows of this machine's accelerators and CPU.

    Attributes:
        gpus: Tuple of `GpuFacts`, empty on a machine without visible GPUs.
        tpu: Bool. True when TensorFlow lists a TPU device.
        cpu_name: String. CPU model name, e.g. ``"AMD EPYC"``.
        cpu_flags: Frozenset of lowercase CPU feature flags, e.g.
            ``{"avx512f", "avx512_bf16"}``.

    Example:
        >>> a100 = DeviceFacts(gpus=(GpuFacts("NVIDIA A100", (8, 0)),))
        >>> a100.min_compute_capability
        (8, 0)
    """

    gpus: Tuple[GpuFacts, ...] = ()
    tpu: bool = False
    cpu_name: str = "unknown CPU"
    cpu_flags: frozenset = frozenset()

    @property
    def cpu_bf16_flags(self) -> Tuple[str, ...]:
        """Tuple of strings. The bfloat16 flags of `CPU_BF16_FLAGS` present."""
        return tuple(flag for flag in CPU_BF16_FLAGS if flag in self.cpu_flags)

    @property
    def weakest_gpu(self) -> Optional[GpuFacts]:
        """`GpuFacts` of the GPU with the lowest compute capability, or None.

        With mixed GPUs the weakest one sets the pace of synchronous training,
        so the policy is chosen for it. A GPU whose compute capability is unknown
        counts as the weakest: nothing can be assumed of it.
        """
        if not self.gpus:
            return None
        return min(self.gpus, key=lambda g: g.compute_capability or (-1, -1))

    @property
    def min_compute_capability(self) -> Optional[Tuple[int, int]]:
        """Tuple ``(major, minor)`` of `weakest_gpu`; None without GPUs or when unknown."""
        gpu = self.weakest_gpu
        return gpu.compute_capability if gpu is not None else None


def _read_cpu_info() -> Tuple[str, frozenset]:
    """Returns (model name, flags) from /proc/cpuinfo; empty flags elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return platform.processor() or "unknown CPU", frozenset()
    name, flags = "unknown CPU", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and name == "unknown CPU":
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return name, flags


def _read_gpus() -> Tuple[GpuFacts, ...]:
    import tensorflow as tf

    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(device)
        cc = details.get("compute_capability")
        gpus.append(
            GpuFacts(
                name=details.get("device_name", device.name),
                compute_capability=tuple(cc) if cc else None,
            )
        )
    return tuple(gpus)


@functools.lru_cache(maxsize=1)
def detect_device_facts() -> DeviceFacts:
    """Reads this machine's device facts once per process.

    Returns:
        `DeviceFacts` of the visible GPUs (with compute capability), TPUs, and the
        CPU's model name and flags.
    """
    import tensorflow as tf

    cpu_name, cpu_flags = _read_cpu_info()
    return DeviceFacts(
        gpus=_read_gpus(),
        tpu=bool(tf.config.list_physical_devices("TPU")),
        cpu_name=cpu_name,
        cpu_flags=cpu_flags,
    )
