"""Optimizer updates: Keras's chain of ops versus TensorFlow's fused kernels, on each model's weights.

For each workload of `benchmarks.workloads` and each optimizer of `OPTIMIZERS`
(Adam; SGD without momentum, with momentum 0.9, with Nesterov momentum), the
workload's trainable float32 variables (the master weights) are updated by the
optimizer's ``apply`` inside a `tf.function`, once as Keras writes it and once
within `tfmp._src.policy.fused_update.fused_updates` (what
`tfmp.LossScaleOptimizer` runs), with the same gradients, the two alternated for
``--repeats`` repeats of ``--calls`` calls each. Reported per workload and
optimizer: parameters, median ms per update of each, the median of the paired
per-repeat speed ratios and the ratio of the fastest repeats, and how far the
two sets of weights are apart after the timed updates (largest difference, as a
fraction of the largest total change).

    python benchmarks/fused_update.py               # MLP, Transformer, ResNet50, ViT; every optimizer
    python benchmarks/fused_update.py --models mlp --optimizers adam --repeats 15 --json adam.json
    python benchmarks/fused_update.py --quick       # tiny sizes: checks it runs
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tfmp

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import harness, report, run  # noqa: E402
from benchmarks.workloads import workloads  # noqa: E402
from tfmp._src.policy.fused_update import fused_updates  # noqa: E402

MODELS = ("mlp", "transformer", "resnet50", "vit")
FULL = dict(repeats=9, calls=10)
QUICK = dict(repeats=2, calls=1)
VARIANTS = ("keras", "fused")
#: Name -> the optimizer timed (learning rates of the benchmarks' order of magnitude).
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "sgd": lambda: keras.optimizers.SGD(1e-2),
    "momentum": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
}


def _updater(shapes: List[tuple], optimizer_name: str, fused: bool, seed: int = 0):
    """Variables of `shapes`, the optimizer built on them and a traced update; returns (variables, update)."""
    rng = np.random.default_rng(seed)
    variables = [keras.Variable(0.05 * rng.normal(size=s).astype("float32")) for s in shapes]
    optimizer = OPTIMIZERS[optimizer_name]()
    optimizer.build(variables)

    @tf.function
    def update(grads):
        if fused:
            with fused_updates(optimizer):
                optimizer.apply(grads, variables)
        else:
            optimizer.apply(grads, variables)

    return variables, update


def bench_optimizer(shapes: List[tuple], grads: List[tf.Tensor], optimizer_name: str,
                    repeats: int, calls: int) -> dict:
    """Times Keras's and the fused update of one optimizer on variables of `shapes`."""
    initial, _ = _updater(shapes, optimizer_name, False)  # the same seed: the starting weights of both
    start = [np.asarray(v) for v in initial]
    runs = {v: _updater(shapes, optimizer_name, v == "fused") for v in VARIANTS}
    for _, update in runs.values():
        update(grads)  # trace outside the timing
    ms = harness.time_alternately(
        {v: functools.partial(runs[v][1], grads) for v in VARIANTS}, repeats, calls)
    keras_weights = [np.asarray(v) for v in runs["keras"][0]]
    fused_weights = [np.asarray(v) for v in runs["fused"][0]]
    change = max(float(np.abs(k - s).max()) for k, s in zip(keras_weights, start))
    apart = max(float(np.abs(k - f).max()) for k, f in zip(keras_weights, fused_weights))
    speed = {v: [1.0 / t for t in ms[v]] for v in VARIANTS}
    return {"updates": repeats * calls + 1, "ms": ms,
            "median_ms": {v: statistics.median(ms[v]) for v in VARIANTS},
            "fused_vs_keras": report.ratio_forms(speed["fused"], speed["keras"]),
            "largest_difference": apart, "largest_change": change}


def bench_model(name: str, quick: bool, optimizers: Sequence[str], repeats: int, calls: int) -> dict:
    """`bench_optimizer` of each of `optimizers` on the weights of workload `name`."""
    model = workloads(quick)[name].build()
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    rng = np.random.default_rng(1)
    grads = [tf.constant(1e-3 * rng.normal(size=s).astype("float32")) for s in shapes]
    return {"parameters": int(sum(np.prod(s) for s in shapes)), "variables": len(shapes),
            "optimizers": {o: bench_optimizer(shapes, grads, o, repeats, calls) for o in optimizers}}


def measure(models: Optional[Sequence[str]] = None, quick: bool = False,
            repeats: Optional[int] = None, optimizers: Optional[Sequence[str]] = None) -> dict:
    """Runs `bench_model` on each model; returns every number (the ``--json`` content).

    Args:
        models: Workload names (default `MODELS`; ResNet50 exists at full size only).
        quick: Bool. Tiny sizes, 2 repeats of 1 call: checks that it runs.
        repeats: Int >= 1 or None (9, or 2 with `quick`).
        optimizers: Names of `OPTIMIZERS` (default all).

    Returns:
        Dict: ``machine`` (`run.machine`, with ``load_average_end``), ``sizes``,
        ``models`` (name -> `bench_model`'s dict), ``duration_s``.
    """
    sizes = dict(QUICK if quick else FULL)
    if repeats is not None:
        sizes["repeats"] = repeats
    began = time.perf_counter()
    available = workloads(quick)
    names = [n for n in (models or MODELS) if n in available]
    results = {"machine": run.machine(), "sizes": sizes, "models": {}}
    for name in names:
        run._log(f"  {name}")
        results["models"][name] = bench_model(name, quick, list(optimizers or OPTIMIZERS),
                                              sizes["repeats"], sizes["calls"])
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["duration_s"] = time.perf_counter() - began
    return results


def markdown(results: dict) -> str:
    """The machine line and one table row per model and optimizer."""
    rows = [[name, f"{m['parameters']:,}", optimizer, f"{r['median_ms']['keras']:.2f}",
             f"{r['median_ms']['fused']:.2f}", f"{r['fused_vs_keras']['paired']:.2f}x",
             f"{r['fused_vs_keras']['fastest']:.2f}x",
             f"{r['largest_difference'] / r['largest_change']:.1e}"]
            for name, m in results["models"].items() for optimizer, r in m["optimizers"].items()]
    return "\n".join([report.machine_line(results["machine"], results["duration_s"]), ""] + report.table(
        ["model", "float32 parameters", "optimizer", "Keras ms", "fused ms",
         "fused / Keras speed (paired)", "fastest", "weights apart / total change"], rows))


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Command line (module docstring); prints the table and returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run.add_common_arguments(parser, "timed repeats (default 9; 2 with --quick)")
    parser.add_argument("--models", nargs="+", choices=MODELS, help="only these workloads")
    parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS),
                        help="only these optimizers (default all)")
    args = run.parse_checked(parser, argv)
    results = measure(args.models, args.quick, args.repeats, args.optimizers)
    return run.publish(results, markdown(results), args.json)


if __name__ == "__main__":
    main()
