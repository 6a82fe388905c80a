"""A sparse cross-entropy from bfloat16 logits: Keras's path against tfmp's two fused passes.

For each (rows, classes) shape, forward and backward of the mean from-logits sparse
cross-entropy of bfloat16 logits, each variant one `tf.function`, traced and run once
untimed, then called alternately:

- **Keras**: the logits cast to float32 (what ``Loss.__call__`` and tfmp's logits rule do),
  ``tf.nn.sparse_softmax_cross_entropy_with_logits`` (Keras's TensorFlow backend), the
  gradient cast back to bfloat16 by the cast's own gradient;
- **fused**: `tfmp._src.float32.cross_entropy.fused`, which an attached bfloat16 model's
  train and test steps take on a CPU (``Attachment.cross_entropy``).

Reported per shape: the fastest call of each, their ratio, the median of the per-round
ratios, and the largest relative difference of the mean loss and of the gradient (in units
of the gradient's largest magnitude) between the two.

Shapes: the suite's decoder (32 x 80 tokens, vocabulary 2,000), its GPT-2 (8 x 128,
8,000) and BART (8 x 64, 8,000), and a 32k vocabulary (4 x 512 tokens).

    python benchmarks/cross_entropy.py
    python benchmarks/cross_entropy.py --json cross_entropy.json
    python benchmarks/cross_entropy.py --quick      # tiny sizes: checks it runs
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tfmp

import tensorflow as tf  # noqa: E402

from benchmarks import report, run  # noqa: E402
from tfmp._src.float32 import cross_entropy  # noqa: E402

SHAPES = {"decoder": (2560, 2000), "gpt2": (1024, 8000), "bart": (512, 8000), "32k vocabulary": (2048, 32000)}
QUICK_SHAPES = {"tiny": (64, 50)}


def _keras(labels, logits):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.cast(logits, tf.float32))


VARIANTS = {"keras": _keras, "fused": cross_entropy.fused}


def _step(loss):
    """A `tf.function` ``(labels, logits) -> (mean loss, gradient to the logits)``."""

    @tf.function(autograph=False)
    def step(labels, logits):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            value = tf.reduce_mean(loss(labels, logits))
        return value, tape.gradient(value, logits)

    return step


def timing(label: str, shape: tuple, repeats: int, budget_s: float) -> dict:
    """Both variants on one shape, alternated, at most `repeats` rounds or `budget_s` seconds."""
    rows, classes = shape
    logits = tf.cast(tf.random.stateless_normal(shape, seed=(1, 2)) * 4.0, tf.bfloat16)
    labels = tf.random.stateless_uniform((rows,), seed=(3, 4), maxval=classes, dtype=tf.int32)
    steps = {name: _step(loss) for name, loss in VARIANTS.items()}
    results = {name: step(labels, logits) for name, step in steps.items()}  # traced, compiled: untimed
    times = {name: [] for name in steps}
    start = time.perf_counter()
    for index in range(max(1, repeats)):
        for name in sorted(steps, reverse=index % 2 == 1):
            began = time.perf_counter()
            steps[name](labels, logits)[1].numpy()
            times[name].append(1e3 * (time.perf_counter() - began))
        if time.perf_counter() - start > budget_s:
            break
    (keras_loss, keras_grad), (fused_loss, fused_grad) = results["keras"], results["fused"]
    grad_scale = float(tf.reduce_max(tf.abs(tf.cast(keras_grad, tf.float32))))
    return {"shape": label, "size": [rows, classes], "keras_ms": min(times["keras"]),
            "fused_ms": min(times["fused"]), "fastest_ratio": min(times["keras"]) / min(times["fused"]),
            "paired_ratio": statistics.median(k / f for k, f in zip(times["keras"], times["fused"])),
            "rounds": len(times["keras"]),
            "loss_relative_difference": abs(float(fused_loss) - float(keras_loss)) / abs(float(keras_loss)),
            "gradient_difference": float(tf.reduce_max(tf.abs(
                tf.cast(fused_grad, tf.float32) - tf.cast(keras_grad, tf.float32)))) / grad_scale}


def measure(quick: bool = False, repeats: Optional[int] = None) -> dict:
    """Times and differences (module docstring) as one dict, with the machine's facts."""
    start = time.perf_counter()
    repeats = repeats or (2 if quick else 15)
    shapes = QUICK_SHAPES if quick else SHAPES
    results = {"machine": run.machine(), "quick": quick, "repeats": repeats,
               "timings": [timing(label, shape, repeats, 0.05 if quick else 3.0) for label, shape in shapes.items()]}
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["duration_s"] = time.perf_counter() - start
    return results


def markdown(results: dict) -> str:
    """The table of `results`, with the machine line."""
    rows = [[f"{row['shape']} ({' x '.join(str(n) for n in row['size'])})", f"{row['keras_ms']:.2f}",
             f"{row['fused_ms']:.2f}", f"{row['fastest_ratio']:.2f}x", f"{row['paired_ratio']:.2f}x",
             f"{row['loss_relative_difference']:.1e}", f"{row['gradient_difference']:.1e}"]
            for row in results["timings"]]
    return "\n".join(
        [report.machine_line(results["machine"], results["duration_s"]),
         f"At most {results['repeats']} alternated calls per shape.", ""]
        + report.table(["logits (rows x classes)", "Keras ms", "fused ms", "fastest ratio", "paired ratio",
                        "loss rel. difference", "gradient difference"], rows))


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Command line (module docstring); prints the table and returns the results."""
    return run.simple_main(__doc__, "timed calls per shape at most (default 15; 2 with --quick)",
                           measure, markdown, argv)


if __name__ == "__main__":
    main()
