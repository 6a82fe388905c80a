"""A roofline per model: the speed-up 16 bits could give a model, from its own float32 profile.

The roofline model (S. Williams, A. Waterman, D. Patterson, "Roofline: an
insightful visual performance model for multicore architectures", Communications
of the ACM 52(4), 2009) bounds a kernel's speed by the lower of two roofs: the
processor's arithmetic peak and its memory bandwidth times the kernel's
arithmetic intensity. A mixed-precision training step moves each kind of op
under its own roof:

* matmuls and convolutions (compute-bound): at most the measured 16-bit /
  float32 ``tf.matmul`` GFLOP/s ratio faster (the suite's "hardware ceiling");
* elementwise, normalization, softmax, casts, data movement (memory-bound): at
  most twice as fast, the bytes they read and write halved (2 bytes an element
  instead of 4);
* kept at their float32 time: the optimizer update, which reads and writes
  float32 master weights, float32 gradients and float32 slots under every mixed
  policy (Keras's and tfmp's), and host time (no op running: the Python loop,
  callbacks, dispatch), which neither FLOPs nor bytes set.

So, with the three times taken from one float32 step (`split`)::

    roofline speed-up = step / (matmul / max(ratio, 1) + halved / 2 + kept)

where ``step = matmul + halved + kept``; with nothing kept this is
``step / (matmul / ratio + other / 2)``.

A ratio below 1 (16-bit matmuls slower than float32, as on a CPU without
bfloat16 arithmetic, where TensorFlow converts to float32 and back) counts as 1:
a mixed policy can leave its matmuls in float32 (tfmp's "auto" does so on such a
CPU), so the roofline promises no matmul speed-up there, and no slow-down either.

`benchmarks/run.py` profiles each model's float32 configuration for a few steps
(`benchmarks.profile_step.profile_run`), keeps `split` of its shares, and
`add_roofline_fractions` reports tfmp / float32 as a fraction of the roofline.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional

from tfmp._src.errors import invalid_argument

#: 16-bit over float32 speed of memory-bound ops: half the bytes (4 per element -> 2).
ELEMENTWISE_RATIO = 2.0
#: `benchmarks.op_classes` categories whose time does not shrink under 16 bits (module docstring).
KEPT = ("optimizer", "host")
#: The categories of compute-bound ops, at the matmul ratio.
MATMUL = ("matmul",)
#: The ratio forms of `benchmarks.report` (median ratio, paired, fastest repeats).
FORMS = ("value", "paired", "fastest")


def roofline_speed_up(step_time: float, matmul_time: float, other_time: float, matmul_ratio: float) -> float:
    """The speed-up over float32 of a step whose ops each run at their 16-bit roof.

    Args:
        step_time: Float > 0. The float32 step's time (any unit, e.g. ms, or 1.0
            for shares of the step).
        matmul_time: Float >= 0. Time of its matmuls and convolutions, same unit.
        other_time: Float >= 0. Time of its memory-bound ops (elementwise and the
            like), same unit. What is left, ``step_time - matmul_time -
            other_time``, keeps its float32 time (optimizer update, host time).
        matmul_ratio: Float > 0. Measured 16-bit / float32 matmul GFLOP/s; a
            ratio below 1 counts as 1 (module docstring).

    Returns:
        Float >= 1: ``step_time / (matmul_time / max(matmul_ratio, 1) +
        other_time / 2 + kept)``.

    Raises:
        ValueError: (template) a time is negative or not finite, `step_time`
            or `matmul_ratio` is not > 0, or the matmul and other times add up
            to more than the step (beyond float rounding).
    """
    for name, value in (("step_time", step_time), ("matmul_ratio", matmul_ratio)):
        if not _finite(value) or value <= 0:
            raise invalid_argument(name, value, "a finite number > 0", fix=f"Pass e.g. {name}=2.0.")
    for name, value in (("matmul_time", matmul_time), ("other_time", other_time)):
        if not _finite(value) or value < 0:
            raise invalid_argument(name, value, "a finite number >= 0", fix=f"Pass e.g. {name}=0.5.")
    kept = step_time - matmul_time - other_time
    if kept < -1e-9 * step_time:
        raise invalid_argument(
            "other_time", other_time, f"at most step_time - matmul_time = {step_time - matmul_time!r}",
            fix="Pass times of one step, the matmul and other times parts of it.")
    ideal = matmul_time / max(matmul_ratio, 1.0) + other_time / ELEMENTWISE_RATIO + max(kept, 0.0)
    return step_time / ideal


def split(shares: Mapping[str, float]) -> Dict[str, float]:
    """The roofline's three parts of a float32 step, from its profile's shares.

    Args:
        shares: Dict of every `benchmarks.op_classes.CATEGORIES` -> float share
            of the step's wall time (as ``op_classes.breakdown`` gives, adding
            up to 1).

    Returns:
        Dict ``{"matmul", "halved", "kept"}`` of floats adding up to the shares'
        sum: `MATMUL` categories, `KEPT` categories, and every other category
        (the memory-bound ops, whose time halves at the roofline).

    Raises:
        ValueError: (template) a category of `MATMUL` or `KEPT` is missing.
    """
    missing = [c for c in MATMUL + KEPT if c not in shares]
    if missing:
        raise invalid_argument("shares", dict(shares), f"a share for each of {MATMUL + KEPT}",
                               fix="Pass the 'shares' of benchmarks.op_classes.breakdown.")
    return {
        "matmul": sum(shares[c] for c in MATMUL),
        "halved": sum(v for c, v in shares.items() if c not in MATMUL + KEPT),
        "kept": sum(shares[c] for c in KEPT),
    }


def add_roofline_fractions(models: Dict[str, dict], matmul_ratio: Mapping[str, float]) -> None:
    """Adds each model's roofline speed-up and tfmp / float32 as a fraction of it, form by form.

    Args:
        models: Dict model name -> dict with ``ratios`` (``tfmp_vs_float32``
            of `FORMS`, as from `benchmarks.report.ratios`) and ``roofline``:
            None (not profiled) or a dict with ``split`` (as from `split`);
            changed in place: ``roofline["speed_up"]`` (form -> float) and
            ``ratios["tfmp_vs_float32_of_roofline"]`` (form -> float, or None
            when the model was not profiled).
        matmul_ratio: Dict of `FORMS`: 16-bit / float32 ``tf.matmul`` GFLOP/s.
    """
    for model in models.values():
        roofline: Optional[dict] = model.get("roofline")
        if roofline is None:
            model["ratios"]["tfmp_vs_float32_of_roofline"] = None
            continue
        parts = roofline["split"]
        step = parts["matmul"] + parts["halved"] + parts["kept"]
        roofline["speed_up"] = {
            form: roofline_speed_up(step, parts["matmul"], parts["halved"], matmul_ratio[form])
            for form in FORMS}
        speed_up = model["ratios"]["tfmp_vs_float32"]
        model["ratios"]["tfmp_vs_float32_of_roofline"] = {
            form: speed_up[form] / roofline["speed_up"][form] for form in FORMS}


def _finite(value) -> bool:
    """True for an int or float (not a bool) that is neither NaN nor infinite."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
