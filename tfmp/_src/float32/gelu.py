"""Exact GELU computed in float32 inside, per model, where the CPU's bfloat16 GELU is the slow path.

TensorFlow's bfloat16 elementwise CPU kernels convert to float32 and back inside every op
of Keras's GELU chain. `float32_inside` casts ``x`` up once, computes GELU and its gradient
in float32 and rounds each result once. The rule (`decision`): a bfloat16 model on a machine
without GPUs or TPUs. Measurements: benchmarks/README.md, "Exact GELU".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from tfmp._src.float32 import inside
from tfmp._src.keras_hooks import backend_ops
from tfmp._src.policy.hardware import DeviceFacts

#: The one compute dtype changed (float16 is never tfmp's choice on a CPU).
DTYPE = "bfloat16"
#: ``Attachment.gelu`` of a model whose 16-bit exact GELU is computed in float32 inside.
FLOAT32_INSIDE = inside.FLOAT32_INSIDE
#: ``Attachment.gelu`` of a model that keeps Keras's GELU.
KERAS = inside.KERAS
#: Why a bfloat16 model on a CPU takes `FLOAT32_INSIDE` (``Attachment.gelu`` after the colon).
RULE = ("TensorFlow's bfloat16 elementwise CPU kernels convert to float32 and back inside "
        "every op of Keras's GELU (benchmarks/README.md, \"Exact GELU\")")
#: `GeluProbe.source` when asked while a function is traced.
TRACING = "failed: called while tracing"
#: `benchmarks/gelu.py` reports float32 inside as faster from this ratio of Keras's time to its own.
FASTER_RATIO = 1.2
#: The probe's Dense: rows, input features, units.
ROWS, INPUTS, UNITS = 1024, 64, 512
#: Seconds of timed calls after the first (tracing) call of each variant.
BUDGET_S = 0.3
#: Timed calls of each variant at most; the fastest of each is kept.
REPEATS = 15

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@dataclasses.dataclass(frozen=True)
class GeluProbe:
    """One measurement of a Dense + exact GELU step, forward and backward, in one 16-bit dtype.

    Attributes:
        dtype: String. ``"bfloat16"`` or ``"float16"``.
        keras_ms: Float, milliseconds. Fastest step with Keras's GELU; NaN when it could not run.
        float32_ms: Float, milliseconds. Fastest step with `float32_inside`.
        source: String. ``"measured"`` or ``"failed: <error>"``.
        paired_ratio: Float. Median over rounds of Keras's time over float32 inside's (NaN when not measured).
    """

    dtype: str
    keras_ms: float
    float32_ms: float
    source: str = "measured"
    paired_ratio: float = math.nan

    @property
    def ratio(self) -> float:
        """Float. ``keras_ms / float32_ms`` (NaN when either is unknown)."""
        if not (self.float32_ms > 0 and math.isfinite(self.keras_ms)):
            return math.nan
        return self.keras_ms / self.float32_ms

    @property
    def faster(self) -> bool:
        """Bool. Float32 inside measured at least `FASTER_RATIO` times as fast."""
        return self.ratio >= FASTER_RATIO


def float32_inside(x: Any) -> Any:
    """The exact GELU of 16-bit `x` and its gradient, computed in float32 and rounded once to `x`'s dtype.

    The gradient is `fused_gradient`'s when all but the first dimension of `x` are known.
    """
    import tensorflow as tf

    @tf.custom_gradient
    def gelu(x):
        wide = tf.cast(x, tf.float32)
        y = tf.cast(0.5 * wide * tf.math.erfc(-wide * _SQRT_HALF), x.dtype)  # TensorFlow ops: inference never runs XLA

        def grad(dy):
            if x.shape[1:].is_fully_defined():
                return fused_gradient()(x, dy)
            return _gradient(x, dy)

        return y, grad

    return gelu(x)


def _gradient(x: Any, dy: Any) -> Any:
    """``dy * (Phi(x) + x * phi(x))`` in float32, rounded once to `x`'s dtype (TensorFlow ops)."""
    import tensorflow as tf

    wide = tf.cast(x, tf.float32)
    slope = 0.5 * tf.math.erfc(-wide * _SQRT_HALF) + wide * _INV_SQRT_2PI * tf.exp(-0.5 * wide * wide)
    return tf.cast(tf.cast(dy, tf.float32) * slope, x.dtype)


def fused_gradient() -> Callable:
    """`_gradient` as one XLA-compiled `tf.function`: its dozen elementwise ops fused in one loop (per shape)."""
    return inside.xla_compiled(_gradient)


def _dense_step(gelu: Callable) -> Any:
    """A `tf.function` ``step(x, w, b, dy)``: a Dense layer's ``gelu(x @ w + b)`` and its gradients."""
    import tensorflow as tf

    @tf.function(jit_compile=False, autograph=False)
    def step(x, w, b, dy):
        with tf.device("/CPU:0"), tf.GradientTape() as tape:
            tape.watch([x, w, b])
            y = gelu(tf.add(tf.matmul(x, w), b))  # Keras's Dense: MatMul, then AddV2 of the bias
        return tape.gradient(y, [x, w, b], output_gradients=dy)[0]

    return step


def measure(dtype: str, budget_s: float = BUDGET_S, repeats: int = REPEATS,
            shape: Tuple[int, int, int] = (ROWS, INPUTS, UNITS)) -> GeluProbe:
    """Times a 16-bit Dense + GELU step, forward and backward, with Keras's GELU and with `float32_inside`.

    Alternately, up to `repeats` calls each or `budget_s` seconds; NaN times (``"failed: ..."``) when it cannot run.
    """
    import tensorflow as tf

    if not tf.executing_eagerly():
        return GeluProbe(dtype, math.nan, math.nan, TRACING)
    variants = {"keras": _dense_step(lambda x: tf.nn.gelu(x, approximate=False)),
                "float32": _dense_step(float32_inside)}
    times: Dict[str, List[float]] = {name: [] for name in variants}
    rows, inputs, units = shape
    try:
        with tf.device("/CPU:0"):
            args = (tf.random.stateless_normal((rows, inputs), seed=(31, 1), dtype=dtype),
                    tf.random.stateless_normal((inputs, units), seed=(31, 2), dtype=dtype) * inputs**-0.5,
                    tf.zeros((units,), dtype),
                    tf.random.stateless_normal((rows, units), seed=(31, 3), dtype=dtype))
        for step in variants.values():
            step(*args).numpy()  # tracing and Grappler: not timed
        start = time.perf_counter()
        for index in range(max(1, repeats)):
            for name in sorted(variants, reverse=index % 2 == 1):
                began = time.perf_counter()
                variants[name](*args).numpy()
                times[name].append((time.perf_counter() - began) * 1e3)
            if time.perf_counter() - start > budget_s:
                break
    except tf.errors.OpError as error:
        return GeluProbe(dtype, math.nan, math.nan, f"failed: {type(error).__name__}")
    paired = statistics.median(k / f for k, f in zip(times["keras"], times["float32"]))
    return GeluProbe(dtype, min(times["keras"]), min(times["float32"]), paired_ratio=paired)


def decision(compute_dtype: str, facts: Optional[DeviceFacts] = None) -> str:
    """``Attachment.gelu`` for a model computing in `compute_dtype` here (bfloat16 only, `inside.decided`)."""
    return inside.decided("gelu", compute_dtype, DTYPE, RULE, facts)


def takes_float32_inside(x: Any, approximate: bool) -> bool:
    """Bool. An exact GELU of a bfloat16 `x` in a layer attached with ``gelu`` starting with `FLOAT32_INSIDE`."""
    if approximate or getattr(getattr(x, "dtype", None), "name", None) != DTYPE:
        return False
    return inside.calling_layer_takes("gelu")


def _replace(call: backend_ops.OpCall) -> Any:
    (x,) = call.inputs
    return float32_inside(x) if takes_float32_inside(x, not call.exact) else backend_ops.KERAS


def install() -> backend_ops.Hook:
    """Hooks Keras's TensorFlow backend ``gelu``; ``.remove()`` the returned `Hook` to undo."""
    return backend_ops.subscribe("gelu", _replace, owner="gelu")
