"""The fused float16 matmul trap on CPUs: measured once per process, and the remapper switch.

Grappler's *remapper* rewrites a MatMul followed by a bias add (``BiasAdd``,
which is what Keras's ``Dense`` emits, or under oneDNN an ``AddV2`` with a 1-D
bias) and an activation into one fused matmul. On CPUs where TensorFlow's oneDNN
takes float16 (AVX512_FP16, e.g. Intel Sapphire Rapids, TensorFlow 2.21), that
fused float16 kernel is 100-500x slower than the same ops unfused (issue 29: a
1024-1024-1024-10 MLP step 17,027 ms under ``mixed_float16``, 37.5 ms with the
remapper off, 36.8 ms in float32), while the remapper speeds float32 and
bfloat16 up (24.5 vs 29.5 ms, 13.6 vs 15.1 ms). So the switch is per model,
never global:

* `probe` times a tiny float16 Dense training step (MatMul, bias add, ReLU,
  forward and backward, one `tf.function`, on the CPU) with the remapper on and
  with it off, once per process, and says whether the fused path is the slow
  one (on/off ratio above `SLOW_RATIO`). It decides by measurement, not by CPU
  name: a CPU where nothing is fused measures a ratio near 1.
* `remapper_off` is a context manager that runs the tf.function calls of the
  calling thread, and only those, without the remapper
  (`keras_private.function_call_config`).
* `remapper_trap` is what `tfmp._src.attachment.attach` asks when it attaches
  a model: a model computing in float16 on a machine without GPUs, where the
  probe found the trap, gets its train, test and predict functions run inside
  `remapper_off` (`tfmp._src.keras_hooks.step_scope`), recorded as
  ``Attachment.remapper``. Other models are untouched.
* `warning_clause` is appended to the float16-on-CPU `tfmp.PerformanceWarning`:
  a custom training loop's own `tf.function` is not tfmp's to scope, and the
  clause names the cause and the process-wide workaround.

Tests inject a result with `injected` and drop the cache with `clear_cache`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from typing import Any, Iterator, List, Optional

from tfmp._src.keras_hooks.keras_private import function_call_config
from tfmp._src.policy.hardware import DeviceFacts, detect_device_facts
from tfmp._src.policy.speed_probe import time_step, train_step

#: The fused step counts as the slow one above this on/off time ratio.
SLOW_RATIO = 3.0
#: The probe's batch and width: 64x256 @ 256x256, about 17 MFLOP a step (the
#: forward matmul and the kernel gradient): 2-3 ms on an AMD EPYC Zen 3 without
#: AVX-512 (float16 through Eigen, nothing fused), about 0.15 ms at the float32
#: speed issue 29's CPU reaches unfused, and about 60 ms at the 0.28 GFLOP/s of its
#: fused kernel (17,027 ms for a 4.8 GFLOP step): two fused calls stay well under
#: a second there.
BATCH, UNITS = 64, 256
#: Seconds of timed calls after the first (tracing) call of each variant.
BUDGET_S = 0.5
#: Timed calls of each variant at most; the minimum of each is kept.
REPEATS = 15

_lock = threading.RLock()
_cache: List["FusionProbe"] = []
_injected: List["FusionProbe"] = []


@dataclasses.dataclass(frozen=True)
class FusionProbe:
    """One measurement of the float16 Dense step with Grappler's remapper on and off.

    Attributes:
        fused_ms: Float. Milliseconds of one step with the remapper on (the
            float16 MatMul, bias add and ReLU fused where TensorFlow fuses them);
            NaN when the step could not run.
        unfused_ms: Float. Milliseconds of the same step with the remapper off.
        slow: Bool. True when the fused step is the slow one
            (``fused_ms / unfused_ms > SLOW_RATIO``).
        source: String. ``"measured"``, ``"injected"`` (tests) or
            ``"failed: <error>"``.
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
    """Times the probe step with the remapper on and off, now (not cached).

    Each variant is a `tf.function` of its own, called once first (tracing and
    Grappler), then the two are timed alternately, up to `repeats` calls each,
    stopping once `budget_s` seconds of timed calls have passed (at least one
    call each); the minimum of each is kept.

    Args:
        budget_s: Float. Seconds of timed calls, after the first ones.
        repeats: Int. Timed calls of each variant at most.

    Returns:
        `FusionProbe` with ``source="measured"``, or ``"failed: ..."`` (NaN
        times, ``slow=False``) when TensorFlow cannot run the step here or it
        is called while a function is traced.
    """
    import tensorflow as tf

    if not tf.executing_eagerly():  # inside a trace: timing means nothing there
        return FusionProbe(math.nan, math.nan, False, "failed: called while tracing")
    with tf.device("/CPU:0"):
        try:
            fused, unfused = train_step("float16"), train_step("float16")
            args = _probe_inputs()
            for name, step in (("fused", fused), ("unfused", unfused)):
                _timed(step, args, name)  # tracing and Grappler: not timed
            times = {"fused": [], "unfused": []}
            start = time.perf_counter()
            for index in range(max(1, repeats)):
                order = ("fused", "unfused") if index % 2 == 0 else ("unfused", "fused")
                for name in order:
                    times[name].append(_timed(fused if name == "fused" else unfused, args, name))
                if time.perf_counter() - start > budget_s:
                    break
        except tf.errors.OpError as error:
            return FusionProbe(math.nan, math.nan, False, f"failed: {type(error).__name__}")
    fused_ms, unfused_ms = min(times["fused"]), min(times["unfused"])
    return FusionProbe(fused_ms, unfused_ms, fused_ms > SLOW_RATIO * unfused_ms)


def _probe_inputs() -> tuple:
    """``x`` in float16, float32 master weights: the inputs of `speed_probe.train_step`."""
    import tensorflow as tf

    x = tf.random.stateless_normal((BATCH, UNITS), seed=(29, 1), dtype=tf.float16)
    kernel = tf.random.stateless_normal((UNITS, UNITS), seed=(29, 2), stddev=0.05)
    bias = tf.zeros((UNITS,))
    return x, kernel, bias


def _timed(step: Any, args: tuple, name: str) -> float:
    """Milliseconds of one call of `step` (``"unfused"``: inside `remapper_off`)."""
    scope = remapper_off() if name == "unfused" else contextlib.nullcontext()
    with scope:
        return time_step(step, *args)


def probe() -> FusionProbe:
    """This process's `FusionProbe`: the injected one, else measured once and cached.

    Returns:
        `FusionProbe`. The first call measures (`measure`: 0.2-0.3 s on an
        AMD EPYC Zen 3 without the trap, about 0.6 s when it is the process's
        first `tf.function`; the timed calls bounded by `BUDGET_S`); later
        calls return the same object.
    """
    with _lock:
        if _injected:
            return _injected[-1]
        if not _cache:
            _cache.append(measure())
        return _cache[0]


def clear_cache() -> None:
    """Forgets the measured `FusionProbe`; the next `probe` measures again."""
    with _lock:
        _cache.clear()


@contextlib.contextmanager
def injected(slow: bool, fused_ms: float = 100.0, unfused_ms: float = 1.0) -> Iterator[FusionProbe]:
    """Makes `probe` return a given result inside the block (tests), also nested.

    Args:
        slow: Bool. The injected ``slow``.
        fused_ms: Float. The injected ``fused_ms`` (default 100.0).
        unfused_ms: Float. The injected ``unfused_ms`` (default 1.0).

    Yields:
        The injected `FusionProbe` (``source="injected"``).
    """
    result = FusionProbe(float(fused_ms), float(unfused_ms), bool(slow), "injected")
    with _lock:
        _injected.append(result)
    try:
        yield result
    finally:
        with _lock:
            _injected.remove(result)


def _remapping_off(config: Any) -> None:
    rewrite = config.graph_options.rewrite_options
    rewrite.remapping = type(rewrite).OFF


@contextlib.contextmanager
def remapper_off() -> Iterator[None]:
    """Runs the block's tf.function calls, in this thread only, without Grappler's remapper.

    The rest of the thread's Grappler config stays as it is. A function called
    inside and outside the block is instantiated once for each config, so a
    model scoped this way and another one not scoped do not affect each other.
    """
    with function_call_config(_remapping_off):
        yield


def remapper_trap(compute_dtype: str, facts: Optional[DeviceFacts] = None) -> Optional[FusionProbe]:
    """The probe result when a model computing in `compute_dtype` falls into the trap here, else None.

    Args:
        compute_dtype: String. The model's compute dtype; only ``"float16"`` can.
        facts: `DeviceFacts` or None (this machine). With a GPU or TPU the steps
            do not run on the CPU, and nothing is measured.

    Returns:
        The `FusionProbe` (``slow`` True), or None.
    """
    if compute_dtype != "float16":
        return None
    facts = facts if facts is not None else detect_device_facts()
    if facts.gpus or facts.tpu:
        return None
    result = probe()
    return result if result.slow else None


def warning_clause(compute_dtype: str, facts: DeviceFacts) -> Optional[str]:
    """What the float16-on-CPU `tfmp.PerformanceWarning` adds where the trap was measured, or None.

    Only for this machine's CPU (`facts` are the detected ones) and a float16
    compute dtype: the fused float16 matmul is then measured (`probe`, once per
    process); where it is the slow path, the clause names it, what tfmp does
    about it and the workaround for a custom training loop.

    Args:
        compute_dtype: String. The policy's compute dtype.
        facts: `DeviceFacts` the policy is checked for.

    Returns:
        String or None.
    """
    if compute_dtype != "float16" or facts != detect_device_facts():
        return None
    trap = remapper_trap(compute_dtype, facts)
    if trap is None:
        return None
    return (
        f"here Grappler's remapper fuses each float16 MatMul with its bias add into a "
        f"kernel that crawls ({trap.describe()}); tfmp runs the fit, evaluate and predict "
        "of each mixed_float16 model it attaches without the remapper "
        "(tfmp.attachment(model).remapper), but a custom training loop's own tf.function "
        "is not tfmp's: there call tf.config.optimizer.set_experimental_options("
        "{'remapping': False}) before the first step (process-wide: float32 and bfloat16 "
        "lose the remapper's speed-up too)"
    )
