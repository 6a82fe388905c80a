"""Exact GELU computed in float32 inside, per model, where the CPU's bfloat16 GELU is the slow path.

Keras's exact GELU (``activation="gelu"``, ``keras.activations.gelu``,
``keras.ops.gelu(x, approximate=False)``) ends in TensorFlow's ``tf.nn.gelu``,
``0.5 * x * erfc(-x / sqrt(2))``: a chain of elementwise ops in the compute
dtype, and a longer one for its gradient. TensorFlow's CPU kernels for 16-bit
elementwise ops convert every value to float32 and back inside each op, so the
chain costs more in bfloat16 than in float32. Measured on an AMD EPYC Zen 4
(AVX512_BF16), TensorFlow 2.21, 2026-12-03 17:21 UTC, a bfloat16 Dense layer with
the exact GELU, forward and backward (`benchmarks/gelu.py`, fastest of 15
alternated calls): the benchmark Transformer's FFN (8192 x 128 -> 512) 27.4 ms
with Keras's GELU, 10.6 ms with float32 inside (2.57x; 1.40x before its gradient
was fused by XLA, `fused_gradient`); the ViT's MLP (4096 x 64 -> 128) 4.2 vs 1.9
ms (2.18x); its head (64 x 4096 -> 2048, the matmul's time) 8.5 vs 8.0 ms.
float16 would gain 1.7-1.9x there but is never tfmp's choice on a CPU: left to
Keras, as is the tanh approximation (bfloat16 1.06x standalone, before fusing).

`float32_inside` casts ``x`` to float32 once, computes GELU (forward) and its
derivative ``Phi(x) + x * phi(x)`` (backward) in float32 and rounds each result
once to ``x``'s dtype: the output dtype is Keras's, and each value is the exact
GELU rounded once instead of after every op of the chain (bfloat16, 100,000
values from N(0, 9) against float64: mean error 8.2e-4 against Keras's 9.8e-4,
largest 7.8e-3 against 9.8e-3; gradients 7.7e-4 against 1.1e-3, largest 3.9e-3
against 7.9e-3). Its ``tf.custom_gradient`` keeps only the 16-bit ``x`` for the
backward pass, no more than autodiff keeps of Keras's chain.

Decided per model, once, when tfmp attaches it (`decision`, recorded as
``Attachment.gelu``), from facts that do not move: a model computing in bfloat16
on a machine without GPUs or TPUs takes float32 inside. TensorFlow's bfloat16
elementwise CPU kernels are Eigen's, which convert each value to float32 and back
inside every op on every CPU (AVX512_BF16 and AMX-BF16 serve matmuls, not
``Erfc`` or ``Mul``), so the rule holds wherever the model runs on the CPU; no
timing decides it, as a timing under load would give two processes of one script
two numerics. `measure` times both variants for `benchmarks/gelu.py` (on the Zen
4, 1.45-2.3x in fresh processes, 2.13x-2.57x in the benchmark). GPUs keep Keras's
GELU: their 16-bit elementwise kernels compute natively, as does a layer attached
at its first call (a custom training loop over a model never compiled: its
attachment records no per-model decisions).

The hook (owner ``"gelu"`` in ``keras_hooks.backend_ops.SURFACE``) replaces ``gelu`` of
Keras's TensorFlow backend module (`backend_ops.backend_nn`), which
``keras.ops.gelu`` looks up at each call; it is one of the model-level hooks
(`tfmp._src.attachment.hooks`). A call takes `float32_inside` when
``approximate`` is False, ``x`` is bfloat16, and the layer computing it (the
innermost layer whose call is running) carries an attachment whose ``gelu``
starts with `FLOAT32_INSIDE`: an attached model keeps its decision when it is
called inside a model tfmp did not attach, and a layer `tfmp.detach` took off
computes Keras's GELU. A layer whose ``call`` a wrapper runs directly, not
through ``__call__`` (``TimeDistributed`` does), follows its wrapper's
attachment; a layer shared by two models carries the attachment of the one
attached last, as with every attachment. Every other call is Keras's own. Tests
inject a probe result with `injected`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from tfmp._src.float32 import inside
from tfmp._src.keras_hooks import backend_ops
from tfmp._src.policy.hardware import DeviceFacts

#: The one compute dtype measured and changed (float16 is never tfmp's choice on a CPU).
DTYPE = "bfloat16"
#: ``Attachment.gelu`` of a model whose 16-bit exact GELU is computed in float32 inside.
FLOAT32_INSIDE = inside.FLOAT32_INSIDE
#: ``Attachment.gelu`` of a model that keeps Keras's GELU.
KERAS = inside.KERAS
#: Why a bfloat16 model on a CPU takes `FLOAT32_INSIDE` (``Attachment.gelu`` after the colon).
RULE = ("TensorFlow's bfloat16 elementwise CPU kernels convert to float32 and back inside "
        "every op of Keras's GELU (measured on an AMD EPYC Zen 4: a Dense + GELU step "
        "2.0-2.6x faster with float32 inside)")
#: `GeluProbe.source` when asked while a function is traced.
TRACING = "failed: called while tracing"
#: `benchmarks/gelu.py` reports float32 inside as faster from this ratio of Keras's time to its own.
FASTER_RATIO = 1.2
#: The probe's Dense: 1024 rows of 64 features in, 512 out (GELU over 1024 x 512 values;
#: smaller ones weigh the per-call overhead more).
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
        keras_ms: Float, milliseconds. Fastest call of the probe's Dense step in
            `dtype` with Keras's GELU (``tf.nn.gelu(x, approximate=False)``),
            forward and backward; NaN when it could not run.
        float32_ms: Float, milliseconds. Fastest call of the same step with
            `float32_inside`.
        source: String. ``"measured"``, ``"injected"`` (tests) or ``"failed: <error>"``.
        paired_ratio: Float. Median over the timed rounds of Keras's time over
            float32 inside's in the same round (NaN when not measured); the
            decision reads `ratio`, of the fastest calls.
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

    def describe(self) -> str:
        """String. The figures in one clause, e.g. for ``Attachment.gelu``."""
        if self.source.startswith("failed"):
            return f"the {self.dtype} GELU probe {self.source}"
        return (f"{self.dtype} Dense + GELU forward+backward {self.keras_ms:.3g} ms with Keras's "
                f"GELU, {self.float32_ms:.3g} ms with float32 inside ({self.ratio:.3g}x, "
                f"{self.source}; taken from {FASTER_RATIO:g}x)")


def float32_inside(x: Any) -> Any:
    """The exact GELU of 16-bit `x`, computed in float32 and rounded once to `x`'s dtype.

    Args:
        x: float16 or bfloat16 `tf.Tensor`, any shape.

    Returns:
        `tf.Tensor` of `x`'s shape and dtype. Its gradient is
        ``dy * (Phi(x) + x * phi(x))`` computed in float32 from the saved 16-bit
        `x` and rounded once to `x`'s dtype: by one XLA-compiled kernel
        (`fused_gradient`) when every dimension of `x` but the first is known
        where it is traced, else by TensorFlow's ops one after the other.
    """
    import tensorflow as tf

    @tf.custom_gradient
    def gelu(x):
        wide = tf.cast(x, tf.float32)
        y = tf.cast(0.5 * wide * tf.math.erfc(-wide * _SQRT_HALF), x.dtype)

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


@functools.lru_cache(maxsize=None)
def fused_gradient() -> Callable:
    """The GELU gradient ``(x, dy) -> dy * GELU'(x)`` as one XLA-compiled `tf.function`.

    TensorFlow runs the gradient's dozen elementwise ops one after the other,
    each a pass over float32 memory; XLA fuses them into one loop reading the
    16-bit ``x`` and ``dy`` and writing the 16-bit result. Measured on the AMD
    EPYC Zen 4, 2026-12-03 17:17 UTC (fastest of 15 alternated calls, a bfloat16
    Dense + exact GELU forward and backward): the benchmark Transformer's FFN
    (8192 x 128 -> 512) 32.4 ms with Keras's GELU, 22.1 ms with float32 inside by
    TensorFlow's ops, 12.1 ms with this gradient. XLA compiles it once per
    distinct shape of ``x`` (about 0.1 s on that CPU, 0.2 s for the process's
    first); `float32_inside` calls it only where every dimension but the batch
    is known when the step is traced, so a run compiles it once per batch size.
    The forward pass stays TensorFlow's (four ops; fusing it too took another
    0-10% off there), so inference never runs XLA; a SavedModel of an attached
    model (``model.export``) stores this gradient beside it, as TensorFlow saves
    custom gradients, and loads and serves without tfmp.
    """
    import tensorflow as tf

    return tf.function(_gradient, jit_compile=True, autograph=False, reduce_retracing=True)


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
    """Times a 16-bit Dense + GELU with Keras's GELU and with `float32_inside`, now (not cached).

    What is timed is a Dense layer's forward and backward pass in `dtype`,
    ``gelu(x @ w + b)`` with ``x`` of shape ``(rows, inputs)`` and ``w`` of
    shape ``(inputs, units)``, the gradients of ``x``, ``w`` and ``b``: the
    matmul is included so that a CPU where Grappler fuses the MatMul, bias add
    and Keras's GELU into one kernel measures that fusion too. Each variant is a
    `tf.function` of its own, called once first (tracing), then the two are
    timed alternately, up to `repeats` calls each, stopping once `budget_s`
    seconds of timed calls have passed; the fastest of each is kept.

    Args:
        dtype: String. ``"bfloat16"`` or ``"float16"``.
        budget_s: Float. Seconds of timed calls, after the first ones.
        repeats: Int. Timed calls of each variant at most.
        shape: Tuple ``(rows, inputs, units)`` of ints (`benchmarks/gelu.py`
            times the benchmark models' own).

    Returns:
        `GeluProbe` (``source="failed: ..."`` with NaN times when TensorFlow cannot
        run it here or it is called while a function is traced).
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
    """``Attachment.gelu`` for a model computing in `compute_dtype` on this machine.

    Args:
        compute_dtype: String. The model's compute dtype; only ``"bfloat16"`` changes.
        facts: `DeviceFacts` or None (this machine's, `detect_device_facts`). With
            a GPU or TPU Keras's GELU is kept.

    Returns:
        String: `KERAS` (not bfloat16, or a GPU/TPU), or ``"float32 inside: "`` + `RULE`.
    """
    return inside.decided("gelu", compute_dtype, DTYPE, RULE, facts)


def takes_float32_inside(x: Any, approximate: bool) -> bool:
    """Bool. Whether this call of Keras's backend GELU is computed by `float32_inside`.

    True when `approximate` is False, `x` is a bfloat16 tensor and the layer whose
    call computes it (the innermost layer called, `layer_calls.calling_layer`)
    is attached with ``gelu`` starting with `FLOAT32_INSIDE`: its own model's
    decision, also inside a model tfmp did not attach; not after `tfmp.detach`.
    """
    if approximate or getattr(getattr(x, "dtype", None), "name", None) != DTYPE:
        return False
    return inside.calling_layer_takes("gelu")


def _wrap(next_gelu: Callable) -> Callable:
    @functools.wraps(next_gelu)
    def gelu(x, approximate=True):
        if takes_float32_inside(x, approximate):
            return float32_inside(x)
        return next_gelu(x, approximate)

    return gelu


def install() -> backend_ops.Hook:
    """Hooks Keras's TensorFlow backend ``gelu``; ``.remove()`` the returned `Hook` to undo."""
    return backend_ops.subscribe("gelu", _wrap, owner="gelu")
