"""Choosing a Keras dtype policy: the hardware rules for "auto" and checks of explicit ones.

"auto" is decided from device facts that do not move (table and sources:
docs/guides/policy.md), never from a timing: a `SpeedProbe` is only quoted in
the reason. float16 is never chosen on a CPU (no fast float16 CPU kernels for training).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import keras

from tfmp._src.errors import check_bool, check_type, invalid_argument, warn
from tfmp._src.policy import float16_fusion
from tfmp._src.policy.hardware import ONEDNN_ENV, DeviceFacts, detect_device_facts
from tfmp._src.policy.speed_probe import SpeedProbe, format_factor

MIXED_FLOAT16 = "mixed_float16"
MIXED_BFLOAT16 = "mixed_bfloat16"
FLOAT32 = "float32"
POLICY_CHOICES = ("auto", MIXED_FLOAT16, MIXED_BFLOAT16, FLOAT32)
PURE_16BIT = ("float16", "bfloat16")
#: Float. On a CPU with bfloat16 flags, a bfloat16 step measured below this factor
#: of float32's speed (`SpeedProbe.factor`) is reported as slower than float32: the
#: reason says how to pin float32 (the policy stays the one the facts give).
MIN_BFLOAT16_FACTOR = 0.7

# Common spellings that are not Keras policy names, mapped to the one meant.
_ALIASES = {
    **dict.fromkeys(("fp16", "half", "mixed_fp16", "amp"), MIXED_FLOAT16),
    **dict.fromkeys(("bf16", "mixed_bf16"), MIXED_BFLOAT16),
    **dict.fromkeys(("fp32", "float", "single"), FLOAT32),
}


class PerformanceWarning(UserWarning):
    """A setting will run slower than it could on this machine.

    Warned for an explicit policy slower than float32 here, and when tfmp turns
    off XLA that cannot run with several replicas.
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

    Raises:
        ValueError: (template) `policy` is not a policy name tfmp applies,
            `reason` or `device` not a string, `tf32` neither None nor a bool.
    """

    policy: str
    reason: str
    device: str
    tf32: Optional[bool] = None

    def __post_init__(self) -> None:
        names = (MIXED_FLOAT16, MIXED_BFLOAT16, FLOAT32, *PURE_16BIT)
        if not (isinstance(self.policy, str) and self.policy in names):
            raise invalid_argument("policy", self.policy, "one of " + ", ".join(map(repr, names)),
                                   choices=names, fix="Pass e.g. policy='mixed_float16'.")
        check_type("reason", self.reason, str, "a string",
                   fix="Pass one sentence, e.g. reason='Tensor Cores with float16 (compute capability 7.0)'.")
        check_type("device", self.device, str, "a string", fix="Pass e.g. device=\"GPU 'Tesla V100'\".")
        check_bool("tf32", self.tf32, allow_none=True)

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
    """A short name of the device the policy is chosen for, e.g. ``"GPU 'Tesla T4' (compute capability 7.5)"``."""
    if facts.tpu:
        return "TPU"
    gpu = facts.weakest_gpu
    if gpu is not None:
        return f"GPU '{gpu.name}' (compute capability {gpu.cc_string})"
    flags = ", ".join(facts.cpu_bf16_flags) or "no bfloat16 flags"
    if facts.cpu_bf16_flags and not facts.onednn:
        flags += "; oneDNN off"
    return f"CPU '{facts.cpu_name}' ({flags})"


def recommend_policy(
    device_facts: Optional[DeviceFacts] = None,
    *,
    speed_probe: Optional[SpeedProbe] = None,
) -> PolicyDecision:
    """The policy "auto" picks for this machine, without side effects.

    Args:
        device_facts: `tfmp.DeviceFacts` or None. Facts to decide for; None reads
            this machine's (cached after the first call).
        speed_probe: `tfmp.SpeedProbe` or None. Measured step times of the CPU the
            facts describe, quoted in the reason (advice only: the policy is the
            same with or without it). Nothing is measured here.

    Returns:
        `PolicyDecision` with `.policy`, `.reason`, `.device` and `.tf32`.

    Raises:
        ValueError: (template) `device_facts` is neither None nor a
            `tfmp.DeviceFacts` (a policy name belongs to `tfmp.enable`), or
            `speed_probe` is neither None nor a `tfmp.SpeedProbe`.

    Example:
        >>> from tfmp import DeviceFacts, GpuFacts, SpeedProbe
        >>> recommend_policy(DeviceFacts(gpus=(GpuFacts("Tesla V100", (7, 0)),))).policy
        'mixed_float16'
        >>> cpu = DeviceFacts(cpu_name="AMD EPYC", cpu_flags=frozenset({"avx512_bf16"}))
        >>> recommend_policy(cpu).policy
        'mixed_bfloat16'
        >>> slow = SpeedProbe(float32_ms=1.0, bfloat16_ms=2.0, float16_ms=50.0)
        >>> recommend_policy(cpu, speed_probe=slow).policy  # a timing never decides
        'mixed_bfloat16'
    """
    return _recommend(*_facts_and_probe(device_facts, speed_probe))


def _facts_and_probe(
    device_facts: Optional[DeviceFacts],
    speed_probe: Optional[SpeedProbe],
) -> Tuple[DeviceFacts, Optional[SpeedProbe]]:
    """The facts to decide for (this machine's for None), and the probe to quote, both checked."""
    if device_facts is not None and not isinstance(device_facts, DeviceFacts):
        raise invalid_argument(
            "device_facts", device_facts, "None (this machine) or a tfmp.DeviceFacts",
            fix="Pass None for this machine, or e.g. tfmp.DeviceFacts(cpu_name='CPU'); "
            "a policy name goes in tfmp.enable(policy).",
        )
    if speed_probe is not None and not isinstance(speed_probe, SpeedProbe):
        raise invalid_argument(
            "speed_probe", speed_probe, "None or a tfmp.SpeedProbe",
            fix="Pass e.g. tfmp.SpeedProbe(float32_ms=2.0, bfloat16_ms=1.0, "
            "float16_ms=200.0), or None to measure this CPU.",
        )
    facts = device_facts if device_facts is not None else detect_device_facts()
    return facts, speed_probe


def _measured(dtype: str, probe: Optional[SpeedProbe]) -> str:
    """`` (measured here: ...)`` with `dtype`'s factor, or ``""`` without a probe."""
    if probe is None:
        return ""
    return (f" (measured here: a {dtype} training step runs "
            f"{format_factor(probe.factor(dtype))}x float32's speed)")


def _recommend(facts: DeviceFacts, probe: Optional[SpeedProbe]) -> PolicyDecision:
    device = describe_device(facts)
    if facts.tpu:
        return PolicyDecision(MIXED_BFLOAT16, "TPUs compute matmuls natively in bfloat16, which keeps float32's "
                              "exponent range, so no loss scaling is needed.", device)
    gpu = facts.weakest_gpu
    if gpu is not None:
        return _gpu_decision(gpu.compute_capability, gpu.cc_string, device)
    if facts.cpu_bf16_flags and not facts.onednn:
        return PolicyDecision(FLOAT32, _onednn_off(facts, probe), device)
    flags = "/".join(facts.cpu_bf16_flags).upper()
    if facts.cpu_bf16_flags:
        measured = _measured("bfloat16", probe)
        if not measured and not set(facts.cpu_bf16_flags) - {"bf16"}:
            measured = " (Arm BF16 through the Arm Compute Library; not measured by tfmp)"
        pin = ""
        if probe is not None and probe.factor("bfloat16") < MIN_BFLOAT16_FACTOR:
            pin = (f" That measurement is below {MIN_BFLOAT16_FACTOR}x: where it holds on an "
                   "idle machine (tfmp doctor measures with its spread), pin float32 with "
                   "tfmp.enable('float32').")
        return PolicyDecision(
            MIXED_BFLOAT16, f"The CPU has {flags}, so oneDNN runs bfloat16 matmuls in hardware{measured}.{pin}", device)
    return PolicyDecision(FLOAT32, "The CPU has none of AVX512_BF16, AMX-BF16 (x86) or BF16 (Arm), so it has no "
                          f"hardware bfloat16 matmuls and float32 is kept{_measured('bfloat16', probe)}.", device)


def _gpu_decision(cc, cc_string: str, device: str) -> PolicyDecision:
    if cc is None:
        policy, reason = FLOAT32, ("TensorFlow did not report the GPU's compute capability, so it cannot "
                                   "be told whether it has Tensor Cores; float32 is the safe choice.")
    elif cc >= (8, 0):
        policy, reason = MIXED_BFLOAT16, (f"Compute capability {cc_string} >= 8.0 has bfloat16 Tensor Cores; "
                                          "bfloat16 keeps float32's exponent range, so no loss scaling is needed.")
    elif cc >= (7, 0):
        policy, reason = MIXED_FLOAT16, (f"Compute capability {cc_string} has float16 Tensor Cores (>= 7.0) but "
                                         "no bfloat16 ones (< 8.0), so float16 with dynamic loss scaling is fastest.")
    else:
        policy, reason = FLOAT32, (f"Compute capability {cc_string} < 7.0 has no Tensor Cores, so mixed "
                                   "precision would be slower than float32.")
    return PolicyDecision(policy, reason, device, tf32=policy == MIXED_BFLOAT16)


#: Why a float16 training step is slower than float32 on a CPU whose TensorFlow has no oneDNN float16 kernels.
FLOAT16_CPU = "TensorFlow has no fast float16 CPU kernels for training"
#: ... and on one whose oneDNN takes float16 (`DeviceFacts.onednn_float16`: AVX512_FP16, AMX-FP16): an MLP
#: under tfmp trained at 0.68x float32's speed on a Xeon with AVX512_FP16 (benchmarks/README.md,
#: "float16 on a CPU").
FLOAT16_CPU_ONEDNN = "oneDNN's float16 CPU kernels train slower than float32"


def slower_than_float32(
    policy: str,
    facts: DeviceFacts,
    speed_probe: Optional[SpeedProbe] = None,
) -> Optional[str]:
    """Why the Keras `policy` runs slower than float32 on `facts`' hardware, or None.

    Slower, by the facts as "auto" decides: float16 on any CPU or below compute
    capability 7.0; bfloat16 below 8.0, or on a CPU without bfloat16 flags or
    oneDNN. `speed_probe`'s factor (this machine's) is quoted, deciding nothing.
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
    device = describe_device(facts)
    factor = speed_probe.factor(compute) if speed_probe is not None else None
    measured = (f"a {compute} training step measured {format_factor(factor)}x float32's "
                f"speed on this CPU ({device})" if factor is not None else "")
    if compute == "float16":
        text = FLOAT16_CPU_ONEDNN if facts.onednn_float16 else FLOAT16_CPU
        if factor is None:
            text = f"{text} ({device})"
        elif factor < 1.0:
            text = f"{measured}: {text}"
        else:  # a small step can break even; a model's step adds loss scaling
            text = f"{text} ({measured}), and float16 needs loss scaling at every step"
        return text
    if facts.cpu_bf16_flags:
        if not facts.onednn:
            return _onednn_off(facts, speed_probe)
        return None  # by the flags, as "auto" decides; a measured factor is advice
    if factor is not None and factor < 1.0:
        return f"{measured}: this CPU has no AVX512_BF16, AMX-BF16 or Arm BF16: no hardware bfloat16 matmuls"
    return f"CPU '{facts.cpu_name}' has no AVX512_BF16, AMX-BF16 or Arm BF16: no hardware bfloat16 matmuls"


#: The fix where a CPU with bfloat16 instructions has TensorFlow's oneDNN off (`_onednn_off`'s last sentence).
ONEDNN_FIX = f"Set {ONEDNN_ENV}=1 before TensorFlow starts to use oneDNN."


def _onednn_off(facts: DeviceFacts, probe: Optional[SpeedProbe] = None) -> str:
    """Why a CPU with bfloat16 instructions still gets float32: TensorFlow's oneDNN is off."""
    why = (f"{ONEDNN_ENV}={facts.onednn_env}" if facts.onednn_env
           else f"the default on {facts.system} here")  # TensorFlow's rule: docs/guides/policy.md
    return (
        f"The CPU has {'/'.join(facts.cpu_bf16_flags).upper()}, but TensorFlow's oneDNN is off ({why}): "
        f"Eigen's bfloat16 runs slower{_measured('bfloat16', probe)}. {ONEDNN_FIX}"
    )


def resolve_policy(
    policy: Union[str, keras.DTypePolicy],
    *,
    allow_pure_16bit: bool = False,
    device_facts: Optional[DeviceFacts] = None,
    speed_probe: Optional[SpeedProbe] = None,
) -> PolicyDecision:
    """Validates a requested policy (as `tfmp.enable` takes it) and returns the decision to apply.

    Raises:
        ValueError: (template) unknown policy name or type, a pure 16-bit policy
            without ``allow_pure_16bit=True``, a `device_facts` that is not a
            `DeviceFacts` or a `speed_probe` that is not a `SpeedProbe`.

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
    if name == "auto":
        return recommend_policy(device_facts, speed_probe=speed_probe)
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
        alias = _ALIASES.get(name.lower())
        raise invalid_argument(
            "policy", policy, "one of " + ", ".join(repr(c) for c in POLICY_CHOICES),
            fix=f"Did you mean {alias!r}?" if alias else "Pass e.g. policy='auto' (chosen for this machine).",
            choices=() if alias else POLICY_CHOICES,
        )
    facts, probe = _facts_and_probe(device_facts, speed_probe)
    auto = _recommend(facts, probe)
    compute = keras.DTypePolicy(name).compute_dtype
    slow = slower_than_float32(name, facts, probe)
    if slow:
        path = float16_fusion.warning_clause(compute, facts)
        cause, onednn_off, _ = slow.partition(f" {ONEDNN_FIX}")
        fix = (f"Fix: set {ONEDNN_ENV}=1 before TensorFlow starts, or use tfmp.enable({auto.policy!r})."
               if onednn_off else f"Fix: tfmp.enable('auto') (which picks {auto.policy!r}) or tfmp.enable('float32').")
        warn(f"Policy {name!r} is slower than float32 here{'; ' + path if path else ''}.",
             f"{cause[0].upper()}{cause[1:].rstrip('.')}.", fix,
             PerformanceWarning, section="no-speed-up")  # names the caller of enable() or policy_scope()
        named = slow.replace(f" ({describe_device(facts)})", "")  # the policy line names the device once
        reason = f"Requested explicitly; it is slower than float32 here: {named}."
    else:
        reason = "Requested explicitly."
    return PolicyDecision(name, reason, auto.device, auto.tf32)
