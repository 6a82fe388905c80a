"""The fused float16 matmul trap on CPUs: decided from the CPU's facts, and the remapper switch.

Where TensorFlow's oneDNN takes float16 (`DeviceFacts.onednn_float16`), Grappler's
remapper fuses a float16 MatMul and bias add into a kernel far slower than the ops
unfused, while it speeds float32 and bfloat16 up; so a float16 model there steps
inside `remapper_off`, per model. Measurements: docs/guides/speed.md, "float16 on a CPU".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Iterator, Optional

from tfmp._src.keras_hooks.runtime_options import function_call_config
from tfmp._src.policy.hardware import ONEDNN_FLOAT16_FLAGS, DeviceFacts, detect_device_facts
from tfmp._src.policy.speed_probe import time_step, train_step

#: The fused step counts as the slow one above this on/off time ratio.
SLOW_RATIO = 3.0
#: The probe's batch and width: small enough that even the slow fused kernel runs in well under a second.
BATCH, UNITS = 64, 256
#: Seconds of timed calls after the first (tracing) call of each variant.
BUDGET_S = 0.5
#: Timed calls of each variant at most; the minimum of each is kept.
REPEATS = 15


@dataclasses.dataclass(frozen=True)
class FusionProbe:
    """Milliseconds of the float16 Dense step with Grappler's remapper on (`fused_ms`) and off.

    Times are NaN when the step could not run (`source` ``"failed: <error>"``, else
    ``"measured"``); `slow` is ``fused_ms / unfused_ms > SLOW_RATIO``.
    """

    fused_ms: float
    unfused_ms: float
    slow: bool
    source: str = "measured"

    @property
    def ratio(self) -> float:
        """Float. ``fused_ms / unfused_ms`` (NaN when either is unknown)."""
        if not (self.unfused_ms > 0 and math.isfinite(self.fused_ms)):
            return math.nan
        return self.fused_ms / self.unfused_ms

    def describe(self) -> str:
        """String. The figures in one sentence, e.g. for ``Attachment.remapper``."""
        if self.source.startswith("failed"):
            return f"the float16 fused-matmul probe {self.source}"
        return (
            f"a float16 Dense training step took {self.fused_ms:.3g} ms with Grappler's "
            f"remapper on, {self.unfused_ms:.3g} ms with it off ({self.ratio:.3g}x, "
            f"{self.source}; slow above {SLOW_RATIO:g}x)"
        )


def measure(budget_s: float = BUDGET_S, repeats: int = REPEATS) -> FusionProbe:
    """Times the probe step with the remapper on and off, now (not cached), for benchmarks and advice.

    Each variant is called once untimed, then the two are timed alternately, up to
    `repeats` calls each or until `budget_s` seconds have passed; the minimum of each
    is kept. The result's source is ``"failed: ..."`` (NaN times, ``slow=False``)
    when TensorFlow cannot run the step here or it is called while tracing.
    """
    import tensorflow as tf

    if not tf.executing_eagerly():  # inside a trace: timing means nothing there
        return FusionProbe(math.nan, math.nan, False, "failed: called while tracing")
    with tf.device("/CPU:0"):
        try:
            steps = {"fused": train_step("float16"), "unfused": train_step("float16")}
            args = (tf.random.stateless_normal((BATCH, UNITS), seed=(29, 1), dtype=tf.float16),
                    tf.random.stateless_normal((UNITS, UNITS), seed=(29, 2), stddev=0.05), tf.zeros((UNITS,)))
            for name in steps:
                _timed(steps[name], args, name)  # tracing and Grappler: not timed
            times = {"fused": [], "unfused": []}
            start = time.perf_counter()
            for index in range(max(1, repeats)):
                for name in ("fused", "unfused") if index % 2 == 0 else ("unfused", "fused"):
                    times[name].append(_timed(steps[name], args, name))
                if time.perf_counter() - start > budget_s:
                    break
        except tf.errors.OpError as error:
            return FusionProbe(math.nan, math.nan, False, f"failed: {type(error).__name__}")
    fused_ms, unfused_ms = min(times["fused"]), min(times["unfused"])
    return FusionProbe(fused_ms, unfused_ms, fused_ms > SLOW_RATIO * unfused_ms)


def _timed(step: Any, args: tuple, name: str) -> float:
    """Milliseconds of one call of `step` (``"unfused"``: inside `remapper_off`)."""
    with remapper_off() if name == "unfused" else contextlib.nullcontext():
        return time_step(step, *args)


def _remapping_off(config: Any) -> None:
    rewrite = config.graph_options.rewrite_options
    rewrite.remapping = type(rewrite).OFF


@contextlib.contextmanager
def remapper_off() -> Iterator[None]:
    """Runs the block's tf.function calls, in this thread only, without Grappler's remapper.

    A function called inside and outside the block is instantiated once for each config.
    """
    with function_call_config(_remapping_off):
        yield


#: Why a float16 model runs without the remapper where `remapper_trap` finds the trap.
TRAP = ("TensorFlow's oneDNN takes float16 on this CPU ({flags}), where Grappler's remapper "
        "fuses each float16 MatMul with its bias add into a kernel far slower than the same ops "
        "unfused (docs/guides/speed.md, \"float16 on a CPU\")")


def remapper_trap(compute_dtype: str, facts: Optional[DeviceFacts] = None) -> Optional[str]:
    """`TRAP` for a float16 model on a CPU without GPU or TPU where `DeviceFacts.onednn_float16` holds, else None.

    `facts` None reads this machine's.
    """
    if compute_dtype != "float16":
        return None
    facts = facts if facts is not None else detect_device_facts()
    if facts.gpus or facts.tpu or not facts.onednn_float16:
        return None
    flags = ", ".join(flag.upper() for flag in sorted(ONEDNN_FLOAT16_FLAGS) if flag in facts.cpu_flags)
    return TRAP.format(flags=flags)


def warning_clause(compute_dtype: str, facts: DeviceFacts) -> Optional[str]:
    """What the float16-on-CPU `tfmp.PerformanceWarning`'s first line adds where `remapper_trap` finds the
    trap, or None: the path tfmp takes (the guide's section "No speed-up" says the rest)."""
    if remapper_trap(compute_dtype, facts) is None:
        return None
    return "tfmp trains it without Grappler's slow fused float16 MatMul"
