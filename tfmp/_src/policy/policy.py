"""Choosing a Keras dtype policy: the hardware rules for "auto" and checks of explicit ones.

Rules (NVIDIA "Train With Mixed Precision" guide and the TensorFlow mixed-precision
guide; CPU figures measured on a Zen 4 CPU with TF 2.21):

| hardware                                   | policy           |
|--------------------------------------------|------------------|
| TPU                                        | mixed_bfloat16   |
| NVIDIA GPU, compute capability >= 8.0      | mixed_bfloat16   |
| NVIDIA GPU, 7.0 <= compute capability < 8  | mixed_float16    |
| NVIDIA GPU, compute capability < 7.0       | float32          |
| CPU with AVX512_BF16, AMX-BF16 or Arm BF16 | mixed_bfloat16   |
| any other CPU                              | float32          |

CPU flags as `tfmp._src.policy.hardware.CPU_BF16_FLAGS` lists them (sources there);
Arm BF16 (Neoverse V1/V2/N2) is not measured by tfmp.

float16 is never chosen on a CPU: no CPU arithmetic for it, measured 0.59x of
float32 on an MLP. Tensor Cores arrived with compute capability 7.0 (Volta);
bfloat16 Tensor Cores and TF32 with 8.0 (Ampere).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Union

import keras

from tfmp._src.errors import check_bool, invalid_argument
from tfmp._src.policy import float16_fusion
from tfmp._src.policy.hardware import ONEDNN_ENV, DeviceFacts, detect_device_facts

MIXED_FLOAT16 = "mixed_float16"
MIXED_BFLOAT16 = "mixed_bfloat16"
FLOAT32 = "float32"
POLICY_CHOICES = ("auto", MIXED_FLOAT16, MIXED_BFLOAT16, FLOAT32)
PURE_16BIT = ("float16", "bfloat16")

# Common spellings that are not Keras policy names, mapped to the one meant.
_ALIASES = {
    "fp16": MIXED_FLOAT16,
    "half": MIXED_FLOAT16,
    "mixed_fp16": MIXED_FLOAT16,
    "amp": MIXED_FLOAT16,
    "bf16": MIXED_BFLOAT16,
    "mixed_bf16": MIXED_BFLOAT16,
    "fp32": FLOAT32,
    "float": FLOAT32,
    "single": FLOAT32,
}


class PerformanceWarning(UserWarning):
    """A setting will run slower than it could on this machine.

    Raised as a warning for an explicit policy slower than float32 here, and when
    tfmp turns off XLA that cannot run with several replicas.
    """


@dataclasses.dataclass(frozen=True)
class PolicyDecision:
    """The policy tfmp chose or accepted, and why.

    Attributes:
        policy: String. Keras dtype policy name, e.g. ``"mixed_bfloat16"``.
        reason: String. One sentence naming the device fact the choice rests on.
        device: String. The device the choice was made for, e.g.
            ``"CPU 'AMD EPYC' (avx512_bf16)"`` or ``"GPU 'NVIDIA A100' (compute
            capability 8.0)"``.
        tf32: Bool or None. Whether TF32 matmuls are available (compute
            capability >= 8.0); None where TF32 does not apply (CPU, TPU).
    """

    policy: str
    reason: str
    device: str
    tf32: Optional[bool] = None

    @property
    def compute_dtype(self) -> str:
        """String. Dtype of layer computations under `policy`."""
        return keras.DTypePolicy(self.policy).compute_dtype

    @property
    def variable_dtype(self) -> str:
        """String. Dtype of the master weights under `policy`."""
        return keras.DTypePolicy(self.policy).variable_dtype

    @property
    def loss_scaling(self) -> bool:
        """Bool. True when gradients need dynamic loss scaling (float16 compute)."""
        return self.compute_dtype == "float16"

    def __str__(self) -> str:
        text = f"tfmp policy: {self.policy} on {self.device}. {self.reason}"
        if self.tf32 is not None:
            text += f" TF32 matmuls are {'available' if self.tf32 else 'not available'}."
        return text


def describe_device(facts: DeviceFacts) -> str:
    """Returns a short name of the device the policy is chosen for.

    Args:
        facts: `DeviceFacts`.

    Returns:
        String such as ``"GPU 'Tesla T4' (compute capability 7.5)"``.
    """
    if facts.tpu:
        return "TPU"
    gpu = facts.weakest_gpu
    if gpu is not None:
        return f"GPU '{gpu.name}' (compute capability {gpu.cc_string})"
    flags = ", ".join(facts.cpu_bf16_flags) or "no bfloat16 flags"
    if facts.cpu_bf16_flags and not facts.onednn:
        flags += "; oneDNN off"
    return f"CPU '{facts.cpu_name}' ({flags})"


def recommend_policy(device_facts: Optional[DeviceFacts] = None) -> PolicyDecision:
    """The policy "auto" picks for this machine, without side effects.

    Args:
        device_facts: `tfmp.DeviceFacts` or None. Facts to decide for; None reads
            this machine's (cached after the first call).

    Returns:
        `PolicyDecision` with `.policy`, `.reason`, `.device` and `.tf32`.

    Raises:
        ValueError: (template) `device_facts` is neither None nor a
            `tfmp.DeviceFacts` (a policy name belongs to `tfmp.enable`).

    Example:
        >>> from tfmp import DeviceFacts, GpuFacts
        >>> recommend_policy(DeviceFacts(gpus=(GpuFacts("Tesla V100", (7, 0)),))).policy
        'mixed_float16'
    """
    if device_facts is not None and not isinstance(device_facts, DeviceFacts):
        raise invalid_argument(
            "device_facts", device_facts, "None (this machine) or a tfmp.DeviceFacts",
            fix="Call tfmp.recommend_policy() for this machine; to set a policy, "
            "call tfmp.enable(policy).",
        )
    facts = device_facts if device_facts is not None else detect_device_facts()
    device = describe_device(facts)
    if facts.tpu:
        return PolicyDecision(
            MIXED_BFLOAT16,
            "TPUs compute matmuls natively in bfloat16, which keeps float32's "
            "exponent range, so no loss scaling is needed.",
            device,
        )
    gpu = facts.weakest_gpu
    if gpu is not None:
        return _gpu_decision(gpu.compute_capability, gpu.cc_string, device)
    if facts.cpu_bf16_flags and not facts.onednn:
        return PolicyDecision(FLOAT32, _onednn_off(facts), device)
    if facts.cpu_bf16_flags:
        measured = ("measured 1.88x float32 on a Zen 4 CPU"
                    if set(facts.cpu_bf16_flags) - {"bf16"}
                    else "Arm BF16 through the Arm Compute Library; not measured by tfmp")
        return PolicyDecision(
            MIXED_BFLOAT16,
            f"The CPU has {'/'.join(facts.cpu_bf16_flags).upper()}, so oneDNN runs "
            f"bfloat16 matmuls in hardware ({measured}).",
            device,
        )
    return PolicyDecision(
        FLOAT32,
        "The CPU has none of AVX512_BF16, AMX-BF16 (x86) or BF16 (Arm), so 16-bit "
        "compute would be emulated and slower than float32.",
        device,
    )


def _gpu_decision(cc, cc_string: str, device: str) -> PolicyDecision:
    if cc is not None and cc >= (8, 0):
        return PolicyDecision(
            MIXED_BFLOAT16,
            f"Compute capability {cc_string} >= 8.0 has bfloat16 Tensor Cores; "
            "bfloat16 keeps float32's exponent range, so no loss scaling is needed.",
            device,
            tf32=True,
        )
    if cc is not None and cc >= (7, 0):
        return PolicyDecision(
            MIXED_FLOAT16,
            f"Compute capability {cc_string} has float16 Tensor Cores (>= 7.0) but "
            "no bfloat16 ones (< 8.0), so float16 with dynamic loss scaling is fastest.",
            device,
            tf32=False,
        )
    if cc is None:
        return PolicyDecision(
            FLOAT32,
            "TensorFlow did not report the GPU's compute capability, so it cannot "
            "be told whether it has Tensor Cores; float32 is the safe choice.",
            device,
            tf32=False,
        )
    return PolicyDecision(
        FLOAT32,
        f"Compute capability {cc_string} < 7.0 has no Tensor Cores, so mixed "
        "precision would be slower than float32.",
        device,
        tf32=False,
    )


def slower_than_float32(policy: str, facts: DeviceFacts) -> Optional[str]:
    """Why `policy` runs slower than float32 on `facts`' hardware, or None.

    Args:
        policy: String. A Keras policy name.
        facts: `DeviceFacts`.

    Returns:
        String explanation when the policy's 16-bit dtype has no hardware support
        there (float16 on a CPU or below compute capability 7.0; bfloat16 on a
        CPU without bfloat16 flags or below compute capability 8.0), else None.
    """
    compute = keras.DTypePolicy(policy).compute_dtype
    if compute == "float32" or facts.tpu:
        return None
    cc = facts.min_compute_capability
    needed = (7, 0) if compute == "float16" else (8, 0)
    if facts.gpus:
        if cc is None:
            return f"this GPU's compute capability is unknown, so {compute} support is too"
        if cc >= needed:
            return None
        return (
            f"{compute} Tensor Cores need compute capability >= {needed[0]}.0, "
            f"this GPU has {facts.weakest_gpu.cc_string}"
        )
    if compute == "bfloat16" and facts.cpu_bf16_flags:
        return None if facts.onednn else _onednn_off(facts)
    return f"this CPU has no {compute} arithmetic ({describe_device(facts)})"


def _onednn_off(facts: DeviceFacts) -> str:
    """Why a CPU with bfloat16 instructions still gets float32: TensorFlow's oneDNN is off."""
    why = (f"{ONEDNN_ENV}={facts.onednn_env}" if facts.onednn_env
           else f"TensorFlow's default on {facts.system} for this CPU")
    return (
        f"The CPU has {'/'.join(facts.cpu_bf16_flags).upper()}, but TensorFlow's oneDNN "
        f"kernels are off ({why}; TensorFlow 2.21 turns them on by default only on "
        "Linux for x86 and Arm Neoverse V1, and on Windows x86): bfloat16 would run on "
        "Eigen's kernels, which convert to float32 and back, slower than float32. "
        f"Set {ONEDNN_ENV}=1 before TensorFlow starts to use oneDNN."
    )


def resolve_policy(
    policy: Union[str, keras.DTypePolicy],
    *,
    allow_pure_16bit: bool = False,
    device_facts: Optional[DeviceFacts] = None,
) -> PolicyDecision:
    """Validates a requested policy and returns the decision to apply.

    Args:
        policy: String (``"auto"``, ``"mixed_float16"``, ``"mixed_bfloat16"``,
            ``"float32"``) or a `keras.DTypePolicy` with one of those names.
        allow_pure_16bit: Bool. Accept ``"float16"``/``"bfloat16"`` (16-bit
            variables, so no float32 master weights). Default False.
        device_facts: `DeviceFacts` or None (this machine).

    Returns:
        `PolicyDecision`.

    Raises:
        ValueError: unknown policy name or type, or a pure 16-bit policy without
            ``allow_pure_16bit=True``.

    Warns:
        PerformanceWarning: an explicit policy that is slower than float32 here.
    """
    check_bool("allow_pure_16bit", allow_pure_16bit)
    name = policy.name if isinstance(policy, keras.DTypePolicy) else policy
    if not isinstance(name, str):
        raise invalid_argument(
            "policy", policy, "a policy name string or a keras.DTypePolicy",
            fix="Pass e.g. policy='auto'.",
        )
    facts = device_facts if device_facts is not None else detect_device_facts()
    if name == "auto":
        return recommend_policy(facts)
    if name in PURE_16BIT and not allow_pure_16bit:
        raise invalid_argument(
            "policy", policy, "a mixed policy ('mixed_float16', 'mixed_bfloat16')",
            fix=(
                f"A pure {name!r} policy keeps the weights themselves in 16 bits: "
                "no float32 master weights, so small updates round away. Use "
                f"'mixed_{name}', or pass allow_pure_16bit=True if you mean it."
            ),
        )
    if name not in POLICY_CHOICES and name not in PURE_16BIT:
        fix = f"Did you mean {_ALIASES[name.lower()]!r}?" if name.lower() in _ALIASES else ""
        raise invalid_argument(
            "policy", policy, "one of " + ", ".join(repr(c) for c in POLICY_CHOICES),
            fix=fix, choices=POLICY_CHOICES,
        )
    auto = recommend_policy(facts)
    slow = slower_than_float32(name, facts)
    if slow:
        warnings.warn(
            f"Policy {name!r} is slower than float32 here: {slow}. "
            f"Use tfmp.enable('auto') (which picks {auto.policy!r}) or 'float32'."
            + float16_fusion.warning_clause(keras.DTypePolicy(name).compute_dtype, facts),
            PerformanceWarning,
            stacklevel=3,
        )
        reason = f"Requested explicitly; it is slower than float32 here: {slow}."
    else:
        reason = "Requested explicitly."
    return PolicyDecision(name, reason, auto.device, auto.tf32)
