"""Exact GELU computed in float32 inside, per model, where the CPU's 16-bit GELU is the slow path.

Keras's exact GELU (``activation="gelu"``, ``keras.activations.gelu``,
``keras.ops.gelu(x, approximate=False)``) ends in TensorFlow's ``tf.nn.gelu``,
``0.5 * x * erfc(-x / sqrt(2))``: a chain of elementwise ops in the compute
dtype, and a longer one for its gradient. TensorFlow's CPU kernels for 16-bit
elementwise ops convert every value to float32 and back inside each op, so the
chain costs more in bfloat16 than in float32. Measured on an AMD EPYC Zen 4
(AVX512_BF16), TensorFlow 2.21, forward and backward of one GELU (median of 9
repeats, 2026-12-03): 8192 x 512 values (the benchmark Transformer's FFN)
bfloat16 40.9 ms, float32 inside 18.7 ms; float16 34.6 vs 20.6 ms; 4096 x 128
bfloat16 6.65 vs 2.55 ms. The tanh approximation gains nothing there (bfloat16
1.06x, float16 0.78x) and is left to Keras.

`float32_inside` casts ``x`` to float32 once, computes GELU (forward) and its
derivative ``Phi(x) + x * phi(x)`` (backward) in float32 and rounds each result
once to ``x``'s dtype: the output dtype is Keras's, and each value is the exact
GELU rounded once instead of after every op of the chain (bfloat16, 100,000
values from N(0, 9) against float64: largest error 7.8e-3 against Keras's
9.8e-3, mean 8.3e-4 against 9.9e-4; gradients 3.9e-3 against 5.5e-3). Its
``tf.custom_gradient`` keeps only the 16-bit ``x`` for the backward pass, no
more than autodiff keeps of Keras's chain.

Decided per model, once, when tfmp attaches it (`decision`, recorded as
``Attachment.gelu``): a model computing in float16 or bfloat16 on a machine
without GPUs or TPUs, where `probe` measured float32 inside at least
`FASTER_RATIO` times as fast as Keras's 16-bit GELU, forward and backward, in
that dtype. The probe measures on the running CPU instead of reading its name, so
a CPU with fast 16-bit elementwise kernels keeps Keras's GELU. GPUs keep Keras's
GELU: their 16-bit elementwise kernels compute natively. A layer attached at its
first call (a custom training loop over a model never compiled) keeps Keras's
GELU too: that attachment happens while its step is traced, where nothing can be
timed.

The hook (owner ``"gelu"`` in ``keras_hooks.patches.ORDER``) replaces ``gelu`` of
Keras's TensorFlow backend module (`keras_private.backend_nn`), which
``keras.ops.gelu`` looks up at each call; it is one of the model-level hooks
(`tfmp._src.attachment.hooks`). A call takes `float32_inside` when
``approximate`` is False, ``x`` is a float16/bfloat16 tensor of the calling
model's compute dtype, and that model (Keras's entry layer of the running call)
carries an attachment whose ``gelu`` starts with `FLOAT32_INSIDE`; every other
call is Keras's own. Tests inject a probe result with `injected`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

from tfmp._src.attachment import record
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import keras_private, patches
from tfmp._src.policy.hardware import DeviceFacts, detect_device_facts

#: ``Attachment.gelu`` of a model whose 16-bit exact GELU is computed in float32 inside.
FLOAT32_INSIDE = "float32 inside"
#: ``Attachment.gelu`` of a model that keeps Keras's GELU without a measurement.
KERAS = "keras"
#: Float inside is taken when the probe's 16-bit time is at least this many times its own
#: (a margin over the probe's noise: 1.6-2.2x measured on the Zen 4 above).
FASTER_RATIO = 1.2
#: The probe's input: 1024 x 512 values (smaller ones weigh the per-call overhead more):
#: about 4.4 ms (bfloat16) and 2.5 ms (float32 inside) on the Zen 4, ratio 1.72-1.76 in 3 runs.
ROWS, UNITS = 1024, 512
#: Seconds of timed calls after the first (tracing) call of each variant.
BUDGET_S = 0.3
#: Timed calls of each variant at most; the fastest of each is kept.
REPEATS = 15

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_lock = threading.RLock()
_cache: Dict[str, "GeluProbe"] = {}
_injected: List["GeluProbe"] = []


@dataclasses.dataclass(frozen=True)
class GeluProbe:
    """One measurement of the exact GELU's forward and backward pass in one 16-bit dtype.

    Attributes:
        dtype: String. ``"bfloat16"`` or ``"float16"``.
        keras_ms: Float, milliseconds. Fastest call of Keras's chain
            (``tf.nn.gelu(x, approximate=False)``) in `dtype`, with its gradient;
            NaN when it could not run.
        float32_ms: Float, milliseconds. Fastest call of `float32_inside` on the
            same input, with its gradient.
        source: String. ``"measured"``, ``"injected"`` (tests) or ``"failed: <error>"``.
    """

    dtype: str
    keras_ms: float
    float32_ms: float
    source: str = "measured"

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
        return (f"{self.dtype} GELU forward+backward {self.keras_ms:.3g} ms, float32 inside "
                f"{self.float32_ms:.3g} ms ({self.ratio:.3g}x, {self.source}; taken from "
                f"{FASTER_RATIO:g}x)")


def float32_inside(x: Any) -> Any:
    """The exact GELU of 16-bit `x`, computed in float32 and rounded once to `x`'s dtype.

    Args:
        x: float16 or bfloat16 `tf.Tensor`, any shape.

    Returns:
        `tf.Tensor` of `x`'s shape and dtype. Its gradient is
        ``dy * (Phi(x) + x * phi(x))`` computed in float32 from the saved 16-bit
        `x` and rounded once to `x`'s dtype.
    """
    import tensorflow as tf

    @tf.custom_gradient
    def gelu(x):
        wide = tf.cast(x, tf.float32)
        y = tf.cast(0.5 * wide * tf.math.erfc(-wide * _SQRT_HALF), x.dtype)

        def grad(dy):
            wide = tf.cast(x, tf.float32)
            slope = 0.5 * tf.math.erfc(-wide * _SQRT_HALF) + wide * _INV_SQRT_2PI * tf.exp(-0.5 * wide * wide)
            return tf.cast(tf.cast(dy, tf.float32) * slope, x.dtype)

        return y, grad

    return gelu(x)


def _timed_step(gelu: Callable) -> Any:
    import tensorflow as tf

    @tf.function(jit_compile=False, autograph=False)
    def step(x, dy):
        with tf.device("/CPU:0"), tf.GradientTape() as tape:
            tape.watch(x)
            y = gelu(x)
        return tape.gradient(y, x, output_gradients=dy)

    return step


def measure(dtype: str, budget_s: float = BUDGET_S, repeats: int = REPEATS) -> GeluProbe:
    """Times Keras's 16-bit GELU and `float32_inside`, forward and backward, now (not cached).

    Each variant is a `tf.function` of its own, called once first (tracing), then
    the two are timed alternately, up to `repeats` calls each, stopping once
    `budget_s` seconds of timed calls have passed; the fastest of each is kept.

    Args:
        dtype: String. ``"bfloat16"`` or ``"float16"``.
        budget_s: Float. Seconds of timed calls, after the first ones.
        repeats: Int. Timed calls of each variant at most.

    Returns:
        `GeluProbe` (``source="failed: ..."`` with NaN times when TensorFlow cannot
        run it here or it is called while a function is traced).
    """
    import tensorflow as tf

    if not tf.executing_eagerly():
        return GeluProbe(dtype, math.nan, math.nan, "failed: called while tracing")
    variants = {"keras": _timed_step(lambda x: tf.nn.gelu(x, approximate=False)),
                "float32": _timed_step(float32_inside)}
    times: Dict[str, List[float]] = {name: [] for name in variants}
    try:
        with tf.device("/CPU:0"):
            x = tf.random.stateless_normal((ROWS, UNITS), seed=(31, 1), dtype=dtype)
            dy = tf.random.stateless_normal((ROWS, UNITS), seed=(31, 2), dtype=dtype)
        for step in variants.values():
            step(x, dy).numpy()  # tracing and Grappler: not timed
        start = time.perf_counter()
        for index in range(max(1, repeats)):
            for name in sorted(variants, reverse=index % 2 == 1):
                began = time.perf_counter()
                variants[name](x, dy).numpy()
                times[name].append((time.perf_counter() - began) * 1e3)
            if time.perf_counter() - start > budget_s:
                break
    except tf.errors.OpError as error:
        return GeluProbe(dtype, math.nan, math.nan, f"failed: {type(error).__name__}")
    return GeluProbe(dtype, min(times["keras"]), min(times["float32"]))


def probe(dtype: str) -> GeluProbe:
    """This process's `GeluProbe` for `dtype`: the injected one, else measured once and cached.

    Returns:
        `GeluProbe`. The first call per dtype measures (`measure`: about 0.3-0.5 s
        with tracing, bounded by `BUDGET_S`); later calls return the same object.
    """
    with _lock:
        for result in reversed(_injected):
            if result.dtype == dtype:
                return result
        if dtype not in _cache:
            _cache[dtype] = measure(dtype)
        return _cache[dtype]


def clear_cache() -> None:
    """Forgets the measured probes; the next `probe` of each dtype measures again."""
    with _lock:
        _cache.clear()


@contextlib.contextmanager
def injected(faster: bool, dtypes: tuple = LOW_PRECISION) -> Iterator[List[GeluProbe]]:
    """Makes `probe` return a given result for each of `dtypes` inside the block (tests), also nested.

    Args:
        faster: Bool. Whether float32 inside measured faster (2.0 ms against 1.0
            ms) or not (1.0 against 1.0).
        dtypes: Tuple of strings. The dtypes injected (default both 16-bit ones).

    Yields:
        List of the injected `GeluProbe`s (``source="injected"``).
    """
    results = [GeluProbe(dtype, 2.0 if faster else 1.0, 1.0, "injected") for dtype in dtypes]
    with _lock:
        _injected.extend(results)
    try:
        yield results
    finally:
        with _lock:
            for result in results:
                _injected.remove(result)


def decision(compute_dtype: str, facts: Optional[DeviceFacts] = None) -> str:
    """``Attachment.gelu`` for a model computing in `compute_dtype` on this machine.

    Args:
        compute_dtype: String. The model's compute dtype.
        facts: `DeviceFacts` or None (this machine's). With a GPU or TPU nothing is
            measured and Keras's GELU is kept.

    Returns:
        String: `KERAS` (float32 model, or a GPU/TPU), ``"float32 inside: <probe>"``
        or ``"keras: <probe>"`` (measured not faster).
    """
    if compute_dtype not in LOW_PRECISION:
        return KERAS
    facts = facts if facts is not None else detect_device_facts()
    if facts.gpus or facts.tpu:
        return KERAS
    result = probe(compute_dtype)
    return f"{FLOAT32_INSIDE if result.faster else KERAS}: {result.describe()}"


def takes_float32_inside(x: Any, approximate: bool) -> bool:
    """Bool. Whether this call of Keras's backend GELU is computed by `float32_inside`.

    True when `approximate` is False, `x` is a tensor of the running model's 16-bit
    compute dtype and that model's attachment (Keras's entry layer of the running
    call) says `FLOAT32_INSIDE`.
    """
    if approximate:
        return False
    dtype = getattr(getattr(x, "dtype", None), "name", None)
    if dtype not in LOW_PRECISION:
        return False
    entry = keras_private.entry_layer()
    found = record.of(entry) if entry is not None else None
    return (found is not None and found.gelu.startswith(FLOAT32_INSIDE)
            and getattr(entry, "compute_dtype", None) == dtype)


def _wrap(next_gelu: Callable) -> Callable:
    @functools.wraps(next_gelu)
    def gelu(x, approximate=True):
        if takes_float32_inside(x, approximate):
            return float32_inside(x)
        return next_gelu(x, approximate)

    return gelu


def install() -> patches.Hook:
    """Hooks Keras's TensorFlow backend ``gelu``; ``.remove()`` the returned `Hook` to undo."""
    return patches.install(keras_private.backend_nn(), "gelu", _wrap, owner="gelu")
