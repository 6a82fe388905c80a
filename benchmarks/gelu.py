"""The exact GELU under 16 bits on this CPU: Keras's chain against tfmp's float32 inside.

For each Dense shape and 16-bit dtype, a Dense layer with the exact GELU,
``gelu(x @ w + b)``, forward and backward (``tf.nn.gelu(x, approximate=False)``,
what ``activation="gelu"`` runs, against
`tfmp._src.float32.gelu.float32_inside`), timed by `gelu.measure` (each variant
one `tf.function`, traced and run once untimed, then called alternately). Reported
per case: fastest call of each, their ratio, the median of the per-round ratios,
and whether float32 inside measured faster here (bfloat16, from 1.2x: the figure
behind tfmp's rule, which takes float32 inside for every bfloat16 model on a CPU
without timing anything). Then the error of each GELU against float64 (math.erfc) on
100,000 values from N(0, 9): forward values and gradients, mean and largest
absolute error.

Shapes (rows, inputs, units): the probe's own (1024, 64, 512), the Transformer
benchmark's FFN (64 x 128 tokens, 128, 512), the ViT's MLP (64 x 64 patches, 64,
128) and its head's first layer (64, 4096, 2048).

    python benchmarks/gelu.py
    python benchmarks/gelu.py --json gelu.json
    python benchmarks/gelu.py --quick      # tiny sizes: checks it runs
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tfmp

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import report, run  # noqa: E402
from tfmp._src.constants import LOW_PRECISION  # noqa: E402
from tfmp._src.float32 import gelu  # noqa: E402

SHAPES = {"probe": (1024, 64, 512), "transformer FFN": (8192, 128, 512), "ViT MLP": (4096, 64, 128),
          "ViT head": (64, 4096, 2048)}
QUICK_SHAPES = {"tiny": (16, 8, 32)}
#: Values whose errors are measured, drawn from N(0, 3**2).
VALUES, QUICK_VALUES = 100_000, 1_000


def timings(shapes: dict, repeats: int, budget_s: float) -> list:
    """One `gelu.measure` per shape and 16-bit dtype, as rows of dicts."""
    rows = []
    for label, shape in shapes.items():
        for dtype in LOW_PRECISION[::-1]:  # bfloat16 first
            found = gelu.measure(dtype, budget_s=budget_s, repeats=repeats, shape=shape)
            rows.append({"shape": label, "size": list(shape), "dtype": dtype, "keras_ms": found.keras_ms,
                         "float32_inside_ms": found.float32_ms, "fastest_ratio": found.ratio,
                         "paired_ratio": found.paired_ratio,
                         "taken": found.faster and dtype == gelu.DTYPE})
    return rows


def _gelu_and_slope(x: np.ndarray) -> tuple:
    erfc = np.vectorize(math.erfc)
    return (0.5 * x * erfc(-x / math.sqrt(2.0)),
            0.5 * erfc(-x / math.sqrt(2.0)) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))


def errors(values: int) -> list:
    """Absolute errors of each variant's values and gradients against float64, per dtype."""
    rows = []
    variants = {"Keras (16-bit chain)": lambda v: tf.nn.gelu(v, approximate=False),
                "float32 inside": gelu.float32_inside}
    for dtype in LOW_PRECISION[::-1]:
        x = tf.cast(tf.random.stateless_normal((values,), seed=(7, 8)) * 3.0, dtype)
        exact, slope = _gelu_and_slope(tf.cast(x, tf.float64).numpy())
        for label, function in variants.items():
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = function(x)
            grad = tape.gradient(y, x)
            forward = np.abs(tf.cast(y, tf.float64).numpy() - exact)
            backward = np.abs(tf.cast(grad, tf.float64).numpy() - slope)
            rows.append({"dtype": dtype, "variant": label, "values": values,
                         "forward_mean": float(forward.mean()), "forward_max": float(forward.max()),
                         "gradient_mean": float(backward.mean()), "gradient_max": float(backward.max())})
    return rows


def measure(quick: bool = False, repeats: Optional[int] = None) -> dict:
    """Times and errors (module docstring) as one dict, with the machine's facts."""
    start = time.perf_counter()
    repeats = repeats or (2 if quick else 15)
    results = {"machine": run.machine(), "quick": quick, "repeats": repeats,
               "timings": timings(QUICK_SHAPES if quick else SHAPES, repeats, 0.05 if quick else 3.0),
               "errors": errors(QUICK_VALUES if quick else VALUES)}
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["duration_s"] = time.perf_counter() - start
    return results


def markdown(results: dict) -> str:
    """The two tables of `results`, with the machine line."""
    timed = [[f"{row['shape']} ({' x '.join(str(n) for n in row['size'])})", row["dtype"],
              f"{row['keras_ms']:.2f}", f"{row['float32_inside_ms']:.2f}", f"{row['fastest_ratio']:.2f}x",
              f"{row['paired_ratio']:.2f}x", "yes" if row["taken"] else "no"] for row in results["timings"]]
    errors_ = [[row["dtype"], row["variant"], f"{row['forward_mean']:.2e} / {row['forward_max']:.2e}",
                f"{row['gradient_mean']:.2e} / {row['gradient_max']:.2e}"] for row in results["errors"]]
    return "\n".join(
        [report.machine_line(results["machine"], results["duration_s"]),
         f"At most {results['repeats']} alternated calls per case.", ""]
        + report.table(["Dense (rows x inputs x units)", "dtype", "Keras ms", "float32 inside ms",
                        "fastest ratio", "paired ratio", "taken"], timed) + [""]
        + report.table(["dtype", "variant", "forward mean / max abs error",
                        "gradient mean / max abs error"], errors_))


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Command line (module docstring); prints the tables and returns the results."""
    return run.simple_main(__doc__, "timed calls per case at most (default 15; 2 with --quick)",
                           measure, markdown, argv)


if __name__ == "__main__":
    main()
