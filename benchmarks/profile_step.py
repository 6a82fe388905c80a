"""Where the time of one training step goes, per model, under float32, plain Keras mixed and tfmp.

Each workload of `benchmarks.workloads` is built, compiled and warmed up under
each configuration of `benchmarks.harness` (the suite's own), then a few
training steps are traced with TensorFlow's profiler
(``tf.profiler.experimental.start/stop``) and broken down by
`benchmarks.op_classes`: matmul/convolution, normalization, softmax, casts,
elementwise, optimizer update, other ops and host overhead (no op running;
an XLA-compiled function's run, such as tfmp's GELU gradient, counts as one op
of its caller's scope, `op_classes.XLA_TYPE`),
each as a share of the step's wall time, and the op time split into 16-bit,
32-bit and other dtypes.

    python benchmarks/profile_step.py                     # every model, 10 traced steps
    python benchmarks/profile_step.py --models transformer resnet50 --steps 5
    python benchmarks/profile_step.py --quick             # tiny sizes: checks it runs
    python benchmarks/profile_step.py --json profile.json

Tracing adds a little time to every op (the profiler's own records), so the
step times here run somewhat above the suite's; read the shares, and take
speeds from ``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tfmp

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402
from benchmarks import harness, op_classes, report, run  # noqa: E402
from benchmarks.workloads import Workload, workloads  # noqa: E402

#: Short column names of the categories in the printed table.
LABELS = {"matmul": "matmul/conv", "normalization": "norm", "softmax": "softmax", "cast": "cast",
          "elementwise": "elementwise", "optimizer": "optimizer", "other": "other", "host": "host"}


class StepMarker(keras.callbacks.Callback):
    """Records a zero-length profiler event (`op_classes.MARKER`) at the end of every training step."""

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        with tf.profiler.experimental.Trace(op_classes.MARKER):
            pass


def optimizer_scopes(model: keras.Model) -> frozenset:
    """Name scopes of `model`'s optimizer and of the optimizer it wraps (lowercase)."""
    scopes = set(op_classes.DEFAULT_OPTIMIZER_SCOPES)
    optimizer = model.optimizer
    while optimizer is not None:
        scopes.add(optimizer.name.lower())
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return frozenset(scopes)


def profile_run(prepared: harness.ConfiguredRun, steps: int, log_dir: str) -> dict:
    """Traces `steps` + 1 training steps of a warmed-up run; the breakdown of the last `steps`.

    Args:
        prepared: `harness.ConfiguredRun`, warmed up.
        steps: Int >= 1. Steps measured (between the first and the last marker).
        log_dir: String. An empty folder for the profiler's files.

    Returns:
        Dict of `op_classes.breakdown`, plus ``unknown_dtype_functions`` (False
        when the trace named the train function, whose definition gave the dtypes).
    """
    marker = StepMarker()
    callbacks = prepared.callbacks + [marker]
    tf.profiler.experimental.start(log_dir)
    try:
        prepared.model.fit(prepared.dataset, epochs=1, steps_per_epoch=steps + 1, verbose=0,
                           shuffle=False, callbacks=callbacks)
    finally:
        tf.profiler.experimental.stop()
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise RuntimeError(f"The profiler wrote no .xplane.pb under {log_dir}.")
    ops, markers, functions = op_classes.read_trace(paths[-1])
    if len(markers) < steps + 1:
        raise RuntimeError(f"{len(markers)} step markers in the trace, expected {steps + 1}.")
    window = (markers[-steps - 1], markers[-1])
    dtypes = op_classes.function_dtypes(functions)
    out = op_classes.breakdown(ops, window, steps, dtypes, optimizer_scopes(prepared.model))
    out["unknown_dtype_functions"] = not dtypes
    return out


def profile_workload(workload: Workload, policy: str, steps: int, warmup: int, root: str) -> dict:
    """The breakdown of each configuration of `harness.CONFIGS` for one workload."""
    out = {"description": workload.description, "batch_size": workload.batch_size, "configs": {}}
    for config in harness.CONFIGS:
        run._log(f"  {workload.name}: {config}")
        prepared = harness.prepare(workload, config, policy, root, warmup)
        folder = tempfile.mkdtemp(dir=root)
        out["configs"][config] = {"policy": prepared.policy,
                                  **profile_run(prepared, steps, folder)}
        del prepared
        gc.collect()
    return out


def profile(models: Optional[Sequence[str]] = None, quick: bool = False, steps: int = 10,
            warmup: int = 5) -> dict:
    """Profiles the chosen workloads; returns every number (the ``--json`` content).

    Args:
        models: Workload names, or None (all at the chosen size).
        quick: Bool. Tiny sizes (tests).
        steps: Int >= 1. Traced steps per configuration.
        warmup: Int >= 2. Untimed steps first (the first traces the train step).

    Returns:
        Dict: ``machine`` (as `run.machine`, with ``load_average_end``),
        ``policy``, ``steps``, ``models`` (name -> ``configs`` -> breakdown).
    """
    start = time.perf_counter()
    results = {"machine": run.machine(), "policy": tfmp.recommend_policy().policy, "steps": steps}
    policy = run.batchnorm_policy(results["policy"])  # "auto"'s mixed policy, else mixed_bfloat16
    results["mixed_policy"] = policy
    chosen = workloads(quick)
    names = [n for n in models if n in chosen] if models else list(chosen)
    results["models"] = {}
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            results["models"][name] = profile_workload(chosen[name], policy, steps, warmup, root)
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["duration_s"] = time.perf_counter() - start
    return results


def markdown(results: dict) -> str:
    """Markdown tables: shares of the step per category, and the 16-bit share of op time."""
    header = (["model", "config", "step ms"] + [LABELS[c] for c in op_classes.CATEGORIES]
              + ["16-bit / 32-bit / other of op time"])
    rows = []
    for name, model in results["models"].items():
        for config, b in model["configs"].items():
            w = b["width_of_ops"]
            rows.append([name, config, f"{b['step_ms']:.1f}"]
                        + [f"{b['shares'][c]:.0%}" for c in op_classes.CATEGORIES]
                        + [f"{w['16-bit']:.0%} / {w['32-bit']:.0%} / {w['other']:.0%}"])
    lines = report.table(header, rows)
    lines += ["", "Op types of most time under tfmp (share of op time):", ""]
    for name, model in results["models"].items():
        top = model["configs"]["tfmp"]["top_ops"][:5]
        lines.append(f"- {name}: " + ", ".join(
            f"{t['type']} ({t['category']}) {t['share_of_op_time']:.0%}" for t in top))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Command line (module docstring); prints the tables and returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(workloads(False)),
                        help="profile only these workloads")
    parser.add_argument("--steps", type=int, default=10, help="traced steps per configuration")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--json", metavar="PATH", help="write all results to PATH")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    results = profile(args.models, args.quick, args.steps, 2 if args.quick else 5)
    print(report.machine_line(results["machine"], results["duration_s"]))
    print(f"auto: {results['policy']}; mixed configurations: {results['mixed_policy']}\n")
    return run.publish(results, markdown(results), args.json)


if __name__ == "__main__":
    main()
