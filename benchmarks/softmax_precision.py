"""Softmax under bfloat16: what tfmp's forced Softmax buys, and what it costs.

Three ways to run one softmax of bfloat16 attention scores, forward and backward:

* ``16-bit``: plain Keras under ``mixed_bfloat16`` (``tf.nn.softmax`` on bfloat16;
  its gradient ``y * (g - sum(g * y))`` runs in bfloat16 ops);
* ``forced``: tfmp's forced ``Softmax`` layer (input cast to float32, softmax and
  its gradient in float32, probabilities cast back to bfloat16 for the 16-bit code
  around it, `tfmp._src.float32.cast_back`);
* ``16-bit forward, float32 backward``: the 16-bit forward kept, the gradient taken
  in float32 from the bfloat16 probabilities (a custom gradient): what a cheaper
  forced path would have to match.

Reported:

1. Forward: how many probabilities of the 16-bit softmax differ from the float32
   softmax rounded once to bfloat16 (0 means the kernel computes in float32
   inside, as TensorFlow's oneDNN CPU kernel does).
2. Backward: per row, the relative error ``|grad - exact| / |exact|`` (vector
   norms over the row) of the gradient with respect to the scores, against a
   float64 gradient of the same bfloat16 inputs; median and 99th percentile, for
   scores of several spreads (standard deviations of the logits: trained
   attention is peaked, i.e. spread over tens) and row lengths.
3. Cost: time of forward + backward on a ``(64, 4, 128, 128)`` score tensor (the
   Transformer benchmark's attention) for ``16-bit``, ``forced`` and ``forced``
   compiled with XLA (``jit_compile=True``: cast, softmax and cast fused), the
   variants alternated, per-repeat ratios paired.

    python benchmarks/softmax_precision.py
    python benchmarks/softmax_precision.py --json softmax.json
    python benchmarks/softmax_precision.py --quick     # tiny sizes: checks it runs
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tfmp

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import harness, report, run  # noqa: E402

#: Logit spreads (standard deviation of the scores) and row lengths of the precision table.
SPREADS = (1.0, 5.0, 30.0)
ROW_LENGTHS = (128, 2048)
FULL = dict(rows=2048, timing_shape=(64, 4, 128, 128), repeats=9, calls=5)
QUICK = dict(rows=16, timing_shape=(2, 2, 8, 8), repeats=2, calls=1)


def _sixteen_bit(x: tf.Tensor) -> tf.Tensor:
    return tf.nn.softmax(x)


def _forced(x: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.nn.softmax(tf.cast(x, tf.float32)), x.dtype)


@tf.custom_gradient
def _float32_backward(x: tf.Tensor):
    y = tf.nn.softmax(x)

    def grad(upstream: tf.Tensor) -> tf.Tensor:
        y32, g32 = tf.cast(y, tf.float32), tf.cast(upstream, tf.float32)
        return tf.cast(y32 * (g32 - tf.reduce_sum(g32 * y32, -1, keepdims=True)), x.dtype)

    return y, grad


#: The softmax variants of the precision table: label -> function of a bfloat16 tensor.
VARIANTS: Dict[str, Callable[[tf.Tensor], tf.Tensor]] = {
    "16-bit": _sixteen_bit,
    "forced": _forced,
    "16-bit forward, float32 backward": _float32_backward,
}


def _gradient(softmax: Callable, scores: tf.Tensor, upstream: tf.Tensor) -> np.ndarray:
    """d sum(softmax(scores) * upstream) / d scores, as float64."""
    with tf.GradientTape() as tape:
        tape.watch(scores)
        total = tf.reduce_sum(tf.cast(softmax(scores), upstream.dtype) * upstream)
    return tf.cast(tape.gradient(total, scores), tf.float64).numpy()


def precision(rows: int, seed: int = 0) -> dict:
    """The forward check and the backward row errors of every `VARIANTS` entry.

    Args:
        rows: Int >= 1. Rows of scores per (spread, row length) case.
        seed: Int. Seed of NumPy's generator for scores and upstream gradients.

    Returns:
        Dict: ``cases``, a list of dicts with ``spread``, ``row_length``,
        ``forward_differing`` (int, probabilities of the 16-bit softmax that
        differ from float32's rounded once), ``values`` (int) and ``errors``
        (label -> ``median``, ``p99`` of the per-row relative errors, over the rows
        whose exact gradient is above 1e-6 of the upstream gradient's norm,
        ``rows`` their count).
    """
    rng = np.random.default_rng(seed)
    cases = []
    for row_length in ROW_LENGTHS:
        for spread in SPREADS:
            scores = tf.constant(spread * rng.normal(size=(rows, row_length)), tf.bfloat16)
            upstream = tf.constant(rng.normal(size=(rows, row_length)), tf.bfloat16)
            forward_16 = _sixteen_bit(scores)
            forward_32 = _forced(scores)
            differing = int(tf.reduce_sum(tf.cast(tf.not_equal(forward_16, forward_32), tf.int32)))
            s64, g64 = tf.cast(scores, tf.float64), tf.cast(upstream, tf.float64)
            exact = _gradient(tf.nn.softmax, s64, g64)
            norms = np.linalg.norm(exact, axis=-1)
            kept = norms > 1e-6 * np.linalg.norm(g64.numpy(), axis=-1)
            errors = {}
            for label, softmax in VARIANTS.items():
                got = _gradient(softmax, scores, upstream)
                relative = np.linalg.norm(got - exact, axis=-1)[kept] / norms[kept]
                errors[label] = {"median": float(np.median(relative)),
                                 "p99": float(np.percentile(relative, 99)), "rows": int(kept.sum())}
            cases.append({"spread": spread, "row_length": row_length,
                          "forward_differing": differing, "values": rows * row_length,
                          "errors": errors})
    return {"cases": cases}


def cost(shape: Sequence[int], repeats: int, calls: int, seed: int = 1) -> dict:
    """Milliseconds of forward + backward per call, 16-bit vs forced vs forced under XLA.

    Args:
        shape: Sequence of ints. Shape of the bfloat16 score tensor (softmax over the last axis).
        repeats: Int >= 1. Timed repeats, the variants alternated (order rotated).
        calls: Int >= 1. Calls per timed repeat.
        seed: Int. NumPy seed of the scores and upstream gradients.

    Returns:
        Dict: ``shape``, ``ms`` (label -> list of per-repeat ms per call),
        ``median_ms`` (label -> float) and ``ratios`` (``"forced / 16-bit"``,
        ``"forced + XLA / forced"``: `report.ratio_forms` of speeds).
    """
    rng = np.random.default_rng(seed)
    scores = tf.constant(5.0 * rng.normal(size=shape), tf.bfloat16)
    upstream = tf.constant(rng.normal(size=shape), tf.bfloat16)

    def step(softmax: Callable) -> Callable:
        @tf.function
        def forward_backward(x, g):
            with tf.GradientTape() as tape:
                tape.watch(x)
                total = tf.reduce_sum(tf.cast(softmax(x) * g, tf.float32))
            return tape.gradient(total, x)
        return forward_backward

    steps = {"16-bit": step(_sixteen_bit), "forced": step(_forced),
             "forced + XLA": step(tf.function(_forced, jit_compile=True))}
    calls_of = {name: (lambda fn=fn: fn(scores, upstream).numpy()) for name, fn in steps.items()}
    for call in calls_of.values():
        call()  # trace (and compile) outside the timing
    ms = harness.time_alternately(calls_of, repeats, calls)
    speed = {name: [1.0 / t for t in times] for name, times in ms.items()}
    return {"shape": list(shape), "ms": ms,
            "median_ms": {name: statistics.median(times) for name, times in ms.items()},
            "ratios": {"forced / 16-bit": report.ratio_forms(speed["forced"], speed["16-bit"]),
                       "forced + XLA / forced": report.ratio_forms(speed["forced + XLA"],
                                                                   speed["forced"])}}


def measure(quick: bool = False, repeats: Optional[int] = None) -> dict:
    """Runs both parts; returns every number (the ``--json`` content).

    Args:
        quick: Bool. Tiny sizes and 2 repeats: checks that it runs.
        repeats: Int >= 1 or None (9, or 2 with `quick`).

    Returns:
        Dict: ``machine`` (`run.machine`, with ``load_average_end``), ``sizes``,
        ``precision`` (`precision`), ``cost`` (`cost`), ``duration_s``.
    """
    sizes = dict(QUICK if quick else FULL)
    if repeats is not None:
        sizes["repeats"] = repeats
    start = time.perf_counter()
    results = {"machine": run.machine(), "sizes": sizes}
    results["precision"] = precision(sizes["rows"])
    results["cost"] = cost(sizes["timing_shape"], sizes["repeats"], sizes["calls"])
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["duration_s"] = time.perf_counter() - start
    return results


def markdown(results: dict) -> str:
    """The machine line and the precision and cost tables."""
    lines = [report.machine_line(results["machine"], results["duration_s"]), ""]
    labels = list(VARIANTS)
    header = (["spread", "row length", "forward: 16-bit != float32 rounded"]
              + [f"{label}: median / p99" for label in labels])
    rows = [[f"{case['spread']:g}", str(case["row_length"]),
             f"{case['forward_differing']:,} of {case['values']:,}"]
            + [f"{case['errors'][label]['median']:.1e} / {case['errors'][label]['p99']:.1e}"
               for label in labels]
            for case in results["precision"]["cases"]]
    lines += ["Gradient with respect to the scores: per-row relative error against float64.", ""]
    lines += report.table(header, rows)
    c = results["cost"]
    lines += ["", f"Forward + backward of a {tuple(c['shape'])} bfloat16 score tensor, ms per call "
              f"(median of {len(c['ms']['forced'])} repeats):", ""]
    lines += report.table(["variant", "median ms"], [[k, f"{v:.2f}"] for k, v in c["median_ms"].items()])
    lines += [""] + report.table(
        ["speed ratio", "median of per-repeat ratios", "ratio of the fastest repeats"],
        [[k, f"{r['paired']:.3f}x", f"{r['fastest']:.3f}x"] for k, r in c["ratios"].items()])
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Command line (module docstring); prints the tables and returns the results."""
    return run.simple_main(__doc__, "timed repeats of the cost part (default 9; 2 with --quick)",
                           measure, markdown, argv)


if __name__ == "__main__":
    main()
