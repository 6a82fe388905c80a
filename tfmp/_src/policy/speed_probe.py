"""How fast this CPU runs a small training step in float32, bfloat16 and float16.

Advice, never a decision (a timing scatters under load): `tfmp doctor` shows it and a
`SpeedProbe` given to `tfmp.recommend_policy` is quoted in the reason. The step
(`train_step`) is timed after an untimed first call; the fastest step counts.
Measurements: docs/guides/policy.md, "Facts, not timings".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Dict, Optional, Tuple

from tfmp._src.errors import invalid_argument, is_positive_int

#: The dtypes measured, in the order of `SpeedProbe`'s fields.
DTYPES = ("float32", "bfloat16", "float16")
#: Int. Rows of the probe's input batch.
BATCH = 128
#: Int. Features in and out of the probe's Dense-like layer.
UNITS = 256
#: Int. Most timed steps per dtype.
REPEATS = 5
#: Float, milliseconds. Timed steps of one dtype stop once they took this long.
BUDGET_MS = 100.0
#: Float. A dtype stops repeating once one of its steps took this many times float32's.
FAR_SLOWER = 20.0


@dataclasses.dataclass(frozen=True)
class SpeedProbe:
    """Measured step times of a small training step in each dtype, on one CPU.

    Built by `tfmp doctor` (this CPU), or by hand to quote for another machine
    (`tfmp.recommend_policy(facts, speed_probe=...)`).

    Attributes:
        float32_ms: Float, milliseconds. Fastest float32 step.
        bfloat16_ms: Float, milliseconds. Fastest bfloat16 step.
        float16_ms: Float, milliseconds. Fastest float16 step.
        batch: Int. Rows of the input batch (`BATCH` when measured).
        units: Int. Features in and out of the layer (`UNITS` when measured).
        repeats: Tuple of three ints (float32, bfloat16, float16) or None. Timed
            steps of each dtype; None when not measured here.
        wall_ms: Float, milliseconds, or None. Wall time of the whole probe,
            tracing included; None when not measured here.
        factor_ranges: Tuple of three ``(lowest, highest)`` float pairs
            (float32, bfloat16, float16) or None. The spread of each dtype's
            factor over the rounds of `measure_rounds`; None for one round.

    Raises:
        ValueError: (template) a step time that is not a positive finite number,
            a size that is not an integer >= 1, or `repeats` that is not None or
            three integers >= 0.

    Example:
        >>> probe = SpeedProbe(float32_ms=2.0, bfloat16_ms=1.0, float16_ms=200.0)
        >>> probe.factor("bfloat16"), probe.factor("float16"), probe.factor("float32")
        (2.0, 0.01, 1.0)
    """

    float32_ms: float
    bfloat16_ms: float
    float16_ms: float
    batch: int = BATCH
    units: int = UNITS
    repeats: Optional[Tuple[int, int, int]] = None
    wall_ms: Optional[float] = None
    factor_ranges: Optional[Tuple[Tuple[float, float], ...]] = None

    def __post_init__(self) -> None:
        for dtype in DTYPES:
            _check_ms(f"{dtype}_ms", getattr(self, f"{dtype}_ms"))
        for name in ("batch", "units"):
            if not is_positive_int(getattr(self, name)):
                raise invalid_argument(name, getattr(self, name), "an integer >= 1",
                                       fix="Pass the probe's sizes, e.g. 128 and 256.")
        if self.wall_ms is not None:
            _check_ms("wall_ms", self.wall_ms)
        counts = self.repeats
        if counts is not None and not (
                isinstance(counts, tuple) and len(counts) == len(DTYPES)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                        for n in counts)):
            raise invalid_argument("repeats", counts, "None or a tuple of three integers >= 0",
                                   fix="Pass the timed steps of float32, bfloat16 and "
                                   "float16, e.g. (5, 5, 1).")
        ranges = self.factor_ranges
        if ranges is not None and not (
                isinstance(ranges, tuple) and len(ranges) == len(DTYPES)
                and all(isinstance(pair, tuple) and len(pair) == 2
                        and all(_positive_number(f) for f in pair) and pair[0] <= pair[1]
                        for pair in ranges)):
            raise invalid_argument("factor_ranges", ranges,
                                   "None or a tuple of three (lowest, highest) pairs of positive numbers",
                                   fix="Pass e.g. ((1.0, 1.0), (1.6, 2.1), (0.01, 0.02)).")

    def step_ms(self, dtype: str) -> float:
        """Float, milliseconds. The fastest step in `dtype`.

        Raises:
            ValueError: (template) `dtype` is not one of `DTYPES`.
        """
        if dtype not in DTYPES:
            raise invalid_argument("dtype", dtype, "one of " + ", ".join(map(repr, DTYPES)),
                                   choices=DTYPES, fix="Pass e.g. dtype='bfloat16'.")
        return getattr(self, f"{dtype}_ms")

    def factor(self, dtype: str) -> float:
        """Float. float32's step time / `dtype`'s: above 1 the dtype is faster than float32.

        Raises:
            ValueError: (template) `dtype` is not one of `DTYPES`.
        """
        return self.float32_ms / self.step_ms(dtype)

    def to_dict(self) -> Dict[str, Any]:
        """Returns the probe as a JSON-serializable dict.

        Keys: ``step_ms``, ``factor``, ``repeats`` and ``factor_range`` (dicts by
        dtype; ``repeats`` None when not measured here, ``factor_range`` None for
        one round, else ``[lowest, highest]``), ``batch``, ``units``, ``wall_ms``.
        """
        return {
            "step_ms": {dtype: self.step_ms(dtype) for dtype in DTYPES},
            "factor": {dtype: self.factor(dtype) for dtype in DTYPES},
            "batch": self.batch,
            "units": self.units,
            "repeats": dict(zip(DTYPES, self.repeats)) if self.repeats else None,
            "factor_range": ({dtype: list(pair) for dtype, pair in zip(DTYPES, self.factor_ranges)}
                             if self.factor_ranges else None),
            "wall_ms": self.wall_ms,
        }


def _positive_number(value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def _check_ms(name: str, value: Any) -> None:
    if not _positive_number(value):
        raise invalid_argument(name, value, "a positive finite number of milliseconds",
                               fix="Pass the measured step time, e.g. 1.5.")


def format_ms(ms: float) -> str:
    """String. A step time in milliseconds: ``"1.52"``, ``"1552"`` (from 100 ms on)."""
    return f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def format_factor(factor: float) -> str:
    """String. A speed factor to two significant digits: ``"1.9"``, ``"0.82"``, ``"0.02"``."""
    text = f"{factor:.2g}"
    return text if "." in text or "e" in text else text + ".0"


#: Int. Rounds of `measure_rounds` (`tfmp doctor`).
ROUNDS = 3


def measure_rounds(rounds: int = ROUNDS, float16_unfused: bool = False) -> SpeedProbe:
    """Measures the probe `rounds` times now (not cached), for `tfmp doctor`.

    Args:
        rounds: Int >= 1.
        float16_unfused: Bool. Time the float16 step without Grappler's remapper
            (`float16_fusion.remapper_off`), the path tfmp runs float16 on where
            `float16_fusion.remapper_trap` holds, instead of TensorFlow's fused kernel.

    Returns:
        `SpeedProbe`: each dtype's fastest step over all rounds, the timed steps
        and wall times summed, and each dtype's factor range over the rounds.

    Raises:
        ValueError: (template) `rounds` is not an integer >= 1.
    """
    if not is_positive_int(rounds):
        raise invalid_argument("rounds", rounds, "an integer >= 1", fix="Pass e.g. rounds=3.")
    traced: Dict[str, Any] = {}  # the rounds share their traced steps: tracing was 2/3 of the time
    probes = [_measure(float16_unfused, traced) for _ in range(rounds)]
    factors = [[probe.factor(dtype) for probe in probes] for dtype in DTYPES]
    return SpeedProbe(
        *(min(probe.step_ms(dtype) for probe in probes) for dtype in DTYPES),
        batch=BATCH, units=UNITS,
        repeats=tuple(sum(probe.repeats[i] for probe in probes) for i in range(len(DTYPES))),
        wall_ms=sum(probe.wall_ms for probe in probes),
        factor_ranges=tuple((min(found), max(found)) for found in factors),
    )


def _measure(float16_unfused: bool = False, traced: Optional[Dict[str, Any]] = None) -> SpeedProbe:
    """One probe: each dtype warmed up, then timed in turns until `REPEATS`, `BUDGET_MS` or `FAR_SLOWER`.

    `float16_unfused`: float16's calls run inside `float16_fusion.remapper_off`.
    `traced`: dict or None. The inputs and traced steps, filled by the first round
    that gets an empty one and reused by the next (None: traced for this round only).
    """
    import tensorflow as tf

    from tfmp._src.policy import float16_fusion  # it imports this module

    def timed(dtype: str) -> float:
        unfused = float16_unfused and dtype == "float16"
        with float16_fusion.remapper_off() if unfused else contextlib.nullcontext():
            return time_step(*steps[dtype], w, b)

    start = time.perf_counter()
    traced = {} if traced is None else traced
    with tf.device("/CPU:0"):
        if not traced:
            x = tf.random.stateless_uniform((BATCH, UNITS), seed=(1, 2), minval=-1.0, maxval=1.0)
            traced["w"] = tf.random.stateless_uniform((UNITS, UNITS), seed=(3, 4), minval=-1.0,
                                                      maxval=1.0) * (1.0 / UNITS) ** 0.5
            traced["b"] = tf.zeros((UNITS,))
            for dtype in DTYPES:
                inputs = tf.cast(x, dtype)
                step = train_step(dtype)
                step.get_concrete_function(inputs, traced["w"], traced["b"])  # not in the warm-up
                traced[dtype] = (step, inputs)
        w, b = traced["w"], traced["b"]
        steps = {dtype: traced[dtype] for dtype in DTYPES}
        best = {dtype: math.inf for dtype in DTYPES}
        spent = {dtype: 0.0 for dtype in DTYPES}
        count = {dtype: 0 for dtype in DTYPES}
        active = list(DTYPES)
        for dtype in DTYPES:  # warm-up: Grappler, kernel set-up and one step, never timed
            timed(dtype)
        best["float32"] = spent["float32"] = timed("float32")
        count["float32"] = 1
        for _ in range(REPEATS):
            for dtype in list(active):
                if count[dtype] >= REPEATS:
                    active.remove(dtype)
                    continue
                took = timed(dtype)
                best[dtype] = min(best[dtype], took)
                spent[dtype] += took
                count[dtype] += 1
                far = dtype != "float32" and took > FAR_SLOWER * best["float32"]
                if far or spent[dtype] >= BUDGET_MS:
                    active.remove(dtype)
    return SpeedProbe(
        float32_ms=best["float32"], bfloat16_ms=best["bfloat16"], float16_ms=best["float16"],
        batch=BATCH, units=UNITS, repeats=tuple(count[dtype] for dtype in DTYPES),
        wall_ms=(time.perf_counter() - start) * 1e3,
    )


def time_step(step: Any, inputs: Any, w: Any, b: Any) -> float:
    """Float, milliseconds. Wall time of one call of a `train_step` function, its loss fetched."""
    began = time.perf_counter()
    step(inputs, w, b)[0].numpy()
    return (time.perf_counter() - began) * 1e3


def train_step(dtype: str) -> Any:
    """A new `tf.function` ``step(x, w, b) -> (loss, grad_w, grad_b)`` on ``/CPU:0``.

    A Dense + ReLU layer computing in `dtype` (``x`` in `dtype`, shape (batch,
    units)) from float32 master weights ``w`` (units, units) and ``b`` (units,),
    cast as a Keras mixed policy casts them; float32 loss ``mean(y**2)``.
    """
    import tensorflow as tf

    @tf.function(jit_compile=False, autograph=False)  # no Python control flow to convert
    def step(x, w, b):
        with tf.device("/CPU:0"):
            with tf.GradientTape() as tape:
                tape.watch([w, b])
                y = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, tf.cast(w, dtype)), tf.cast(b, dtype)))
                loss = tf.reduce_mean(tf.square(tf.cast(y, tf.float32)))
            grad_w, grad_b = tape.gradient(loss, [w, b])
        return loss, grad_w, grad_b

    return step
