"""Benchmark suite: float32, plain Keras mixed precision and tfmp, side by side.

For each workload (MLP, CNN, Transformer encoder, a keras.io ViT and GPT-style
decoder, and ResNet50 at full size; see `benchmarks.workloads`) the
three configurations of `benchmarks.harness` are built and warmed up, then timed
alternately over several repeats in this one process; medians of samples/s and
their ratios (median of the paired per-repeat ratios and ratio of the fastest
repeats) are printed with the targets of issues 9, 15 and 27, next to the
hardware ceiling (``tf.matmul`` in float32 vs the recommended 16-bit dtype) and
each model's tfmp / float32 as a fraction of it and of the model's roofline
(`benchmarks.roofline`: its float32 step, profiled, with the matmuls at that
ceiling and the memory-bound ops at half their time), the CPU and its flags, and
the memory of each configuration. Then the "Keras BatchNormalization vs fused" line: the CNN
(and ResNet50 at full size) under plain Keras with a mixed policy, Keras's
BatchNormalization against the same model traced with tfmp's fused kernel.

    python benchmarks/run.py                       # full suite, about 12 minutes
    python benchmarks/run.py --json results.json   # also write every number
    python benchmarks/run.py --quick               # tiny sizes: checks it runs
    python benchmarks/run.py --batchnorm-only --models cnn resnet50
    python benchmarks/run.py --policy mixed_bfloat16   # tfmp vs Keras where "auto" is float32
    python benchmarks/run.py --policy float32          # what tfmp costs where "auto" keeps float32
    python benchmarks/run.py --roofline-steps 0        # no float32 profile, roofline "n/a"

Close other work first: the ratios are only as good as the machine is quiet
(the load average is recorded in the results).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tfmp

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402
from benchmarks import harness, report, roofline  # noqa: E402
from benchmarks.workloads import Workload, workloads  # noqa: E402
from tfmp._src.policy import onednn_isa  # noqa: E402
from tfmp._src.policy.hardware import detect_device_facts  # noqa: E402

# (repeats, warm-up steps, seconds per timed call, min steps, max steps,
#  matmul size, matmul products per timed call, float32 steps profiled for the roofline)
FULL = dict(repeats=5, warmup=5, seconds=3.0, min_steps=10, max_steps=2000,
            matmul_size=2048, matmul_iterations=8, roofline_steps=5)
#: Workloads of the "Keras BatchNormalization vs fused" line (those present at the size run).
BATCHNORM_MODELS = ("cnn", "resnet50")
#: ``--policy`` choices: "auto", or a policy run by both plain Keras and tfmp.
POLICIES = ("auto", "mixed_bfloat16", "mixed_float16", "float32")
QUICK = dict(repeats=2, warmup=2, seconds=0.0, min_steps=2, max_steps=2,
             matmul_size=64, matmul_iterations=2, roofline_steps=2)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def machine() -> dict:
    """Facts about where the suite ran: CPU, cores, the ISA oneDNN runs matmuls with, versions, date, load."""
    facts = detect_device_facts()
    return {
        "cpu": facts.cpu_name,
        "cpu_bf16_flags": list(facts.cpu_bf16_flags),
        "cpu_flags": [flag for flag in report.CPU_FLAGS if flag in facts.cpu_flags],
        "onednn_isa": onednn_isa.detect().to_dict(),
        "cores": os.cpu_count(),
        "gpus": [f"{g.name} (cc {g.cc_string})" for g in facts.gpus],
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "tfmp": tfmp.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_start": list(os.getloadavg()),
    }


def bench_matmul(dtype: str, sizes: dict) -> dict:
    """``tf.matmul`` GFLOP/s in float32 and `dtype`, alternated over the repeats."""
    dtypes = ["float32"] + ([dtype] if dtype != "float32" else [])
    timers = {
        d: harness.matmul_gflops(d, sizes["matmul_size"], sizes["matmul_iterations"])
        for d in dtypes
    }
    gflops = {d: [] for d in dtypes}
    for repeat in range(sizes["repeats"]):
        for d in dtypes[repeat % len(dtypes):] + dtypes[: repeat % len(dtypes)]:
            gflops[d].append(timers[d]())
    configs = {
        d: {"gflops": g, "median_gflops": report.summarize_config(g)["median_samples_per_s"]}
        for d, g in gflops.items()
    }
    return {
        "size": sizes["matmul_size"],
        "dtype": dtype,
        "configs": configs,
        "ratio": report.ratio_forms(gflops[dtype], gflops["float32"]),
    }


def bench_workload(
    workload: Workload, policy: str, sizes: dict, log_dir: str,
    configs: Sequence[str] = harness.CONFIGS, tfmp_policy: str = "auto",
) -> dict:
    """Prepares the configurations of one workload and times them alternately."""
    runs = {}
    for config in configs:
        _log(f"  {workload.name}: building and warming up {config}")
        runs[config] = harness.prepare(workload, config, policy, log_dir, sizes["warmup"],
                                       harness.Overrides(tfmp_policy=tfmp_policy))
    out = {"description": workload.description,
           **bench_runs(runs, workload.batch_size, sizes, workload.name)}
    if tuple(configs) == harness.CONFIGS:
        out["ratios"] = report.ratios(out["configs"])
        out["roofline"] = float32_profile(runs["float32"], sizes["roofline_steps"], workload.name)
    else:
        out["ratios"] = {"fused_vs_keras": report.speed_ratio(out["configs"], "fused_bn", "keras_mixed")}
    return out


def float32_profile(float32_run: harness.ConfiguredRun, steps: int, label: str) -> Optional[dict]:
    """The roofline's split of a float32 step (`benchmarks.roofline.split`), from a profile.

    Args:
        float32_run: The workload's warmed-up ``float32`` `harness.ConfiguredRun`.
        steps: Int >= 0. Steps traced (`benchmarks.profile_step.profile_run`,
            with TensorFlow's profiler); 0 profiles nothing.
        label: String. Prefix of the progress line (stderr).

    Returns:
        None when `steps` is 0, else a dict: ``steps``, ``step_ms`` (float, the
        traced step, which tracing slows a little), ``shares`` (category ->
        share of the step, `benchmarks.op_classes.CATEGORIES`) and ``split``.
    """
    if not steps:
        return None
    from benchmarks import profile_step  # it imports this module

    _log(f"  {label}: profiling {steps} float32 steps for the roofline")
    with tempfile.TemporaryDirectory() as folder:
        traced = profile_step.profile_run(float32_run, steps, folder)
    return {"steps": steps, "step_ms": traced["step_ms"], "shares": traced["shares"],
            "split": roofline.split(traced["shares"])}


def bench_runs(
    runs: Dict[str, harness.ConfiguredRun], batch_size: int, sizes: dict, label: str
) -> dict:
    """Times prepared runs alternately, the order rotated each repeat.

    Args:
        runs: Dict name -> warmed-up `harness.ConfiguredRun` (all of `batch_size`).
        batch_size: Int. Samples per step of every run.
        sizes: Dict with ``repeats``, ``seconds``, ``min_steps``, ``max_steps``
            (`FULL`, `QUICK`): the steps per timed call last about ``seconds``
            for the slowest run.
        label: String. Prefix of the progress lines (stderr).

    Returns:
        Dict: ``batch_size``, ``steps_per_repeat`` and ``configs``: per name, the
        run's ``policy``, `report.summarize_config` of its samples/s (one per
        repeat), ``memory`` and ``fused_batchnorm``.
    """
    names = list(runs)
    slowest = max(run.clock.seconds_per_step() for run in runs.values())
    steps = harness.calibrate_steps(
        slowest, sizes["seconds"], sizes["min_steps"], sizes["max_steps"]
    )
    samples = {name: [] for name in names}
    for repeat in range(sizes["repeats"]):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            seconds = runs[name].train(steps)
            samples[name].append(batch_size / seconds)
        _log(f"  {label}: repeat {repeat + 1}/{sizes['repeats']} "
             + ", ".join(f"{n} {samples[n][-1]:,.0f}/s" for n in names))
    out = {"batch_size": batch_size, "steps_per_repeat": steps, "configs": {}}
    for name in names:
        out["configs"][name] = {
            "policy": runs[name].policy,
            **report.summarize_config(samples[name]),
            "memory": runs[name].memory,
            "fused_batchnorm": runs[name].fused_batchnorm,
        }
    return out


def batchnorm_policy(decision_policy: str) -> str:
    """The mixed policy of the BatchNormalization comparison: "auto"'s, else mixed_bfloat16 (emulated)."""
    return decision_policy if decision_policy.startswith("mixed_") else "mixed_bfloat16"


def run_suite(
    quick: bool = False, repeats: Optional[int] = None,
    models: Optional[Sequence[str]] = None, log_dir: Optional[str] = None,
    batchnorm_only: bool = False, policy: str = "auto", roofline_steps: Optional[int] = None,
) -> dict:
    """Runs the suite and returns every number (the ``--json`` content).

    Args:
        quick: Bool. Tiny sizes, two repeats: checks the suite runs.
        repeats: Int or None. Overrides the number of repeats.
        models: Sequence of workload names or None (all).
        log_dir: String or None. Folder for the tfmp monitor's events (a
            temporary folder, removed afterwards, when None).
        batchnorm_only: Bool. Run only the "Keras BatchNormalization vs fused"
            line (``models`` stays empty).
        policy: String. ``"auto"``: tfmp runs ``enable("auto")`` and plain
            Keras the policy "auto" picks. Another of `POLICIES`: both run it.
            A mixed policy measures tfmp's overhead over plain Keras where
            "auto" picks float32 (16 bits may be emulated there: the speed-up
            targets are then "n/a"); ``"float32"`` measures what tfmp costs
            where "auto" keeps float32 (the "costs nothing" target), on any CPU:
            tfmp's hooks, not the CPU's 16-bit kernels, are what it times.
        roofline_steps: Int >= 0 or None. float32 steps profiled per model for
            its roofline (`float32_profile`); 0: no roofline ("n/a"); None: the
            size's default (5, quick 2).

    Returns:
        Dict with ``machine``, ``suite``, ``decision``, ``matmul``, ``models``
        (per model its configurations, ``ratios`` and ``roofline``: see
        `float32_profile` and `benchmarks.roofline.add_roofline_fractions`),
        ``batchnorm`` (``policy`` and, per model of `BATCHNORM_MODELS` run,
        the ``keras_mixed`` and ``fused_bn`` configurations and their
        ``fused_vs_keras`` ratio) and ``targets``.
    """
    sizes = dict(QUICK if quick else FULL)
    if repeats is not None:
        sizes["repeats"] = repeats
    if roofline_steps is not None:
        sizes["roofline_steps"] = roofline_steps
    start = time.perf_counter()
    decision = tfmp.recommend_policy()
    mixed = decision.policy if policy == "auto" else policy
    chosen = workloads(quick)
    names = [n for n in models if n in chosen] if models else list(chosen)
    results = {"machine": machine(), "suite": {"quick": quick, **sizes}}
    results["decision"] = {"policy": decision.policy, "reason": decision.reason,
                           "device": decision.device, "requested": policy, "run": mixed}
    _log(f"tfmp auto: {decision.policy} on {decision.device}; running {policy!r}: {mixed}")
    _log("matmul")
    results["matmul"] = bench_matmul(keras.DTypePolicy(mixed).compute_dtype, sizes)
    with tempfile.TemporaryDirectory() as tmp:
        results["models"] = {}
        for name in ([] if batchnorm_only else names):
            results["models"][name] = bench_workload(
                chosen[name], mixed, sizes, log_dir or tmp, tfmp_policy=policy
            )
            gc.collect()
        bn_names = [n for n in BATCHNORM_MODELS if n in chosen and (not models or n in models)]
        bn_policy = batchnorm_policy(mixed)
        results["batchnorm"] = {"policy": bn_policy, "models": {}}
        for name in bn_names:
            results["batchnorm"]["models"][name] = bench_workload(
                chosen[name], bn_policy, sizes, log_dir or tmp, configs=harness.BN_CONFIGS)
            gc.collect()
    report.add_ceiling_fractions(results["models"], results["matmul"]["ratio"])
    roofline.add_roofline_fractions(results["models"], results["matmul"]["ratio"])
    cpu_only = not detect_device_facts().gpus
    results["targets"] = report.verdicts(
        results["models"], cpu_only and policy == "auto" and decision.compute_dtype == "bfloat16",
        policy == "auto", float32_cpu=cpu_only and mixed == "float32")
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["suite"]["duration_s"] = time.perf_counter() - start
    return results


def add_common_arguments(parser: argparse.ArgumentParser, repeats_help: str) -> None:
    """Adds ``--json``, ``--quick`` and ``--repeats``, shared with ``side_experiments.py``."""
    parser.add_argument("--json", metavar="PATH", help="write all results to PATH")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--repeats", type=int, help=repeats_help)


def parse_checked(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parses `argv`; exits with a usage error (status 2) when ``--repeats`` is below 1."""
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def publish(results: dict, text: str, json_path: Optional[str]) -> dict:
    """Prints `text` and writes `results` as JSON to `json_path` (if any); returns `results`."""
    print(text)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return results


def simple_main(doc: str, repeats_help: str, measure: Callable, markdown: Callable,
                argv: Optional[Sequence[str]]) -> dict:
    """The command line of a benchmark with only ``--json``, ``--quick`` and ``--repeats``.

    Parses `argv`, calls ``measure(quick, repeats)``, prints ``markdown(results)``
    and writes the JSON; returns the results.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_common_arguments(parser, repeats_help)
    args = parse_checked(parser, argv)
    results = measure(args.quick, args.repeats)
    return publish(results, markdown(results), args.json)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Command line of the suite (module docstring); prints its tables.

    Args:
        argv: Sequence of strings or None (``sys.argv[1:]``).

    Returns:
        Dict of results (as written with ``--json``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, "timed repeats per config")
    parser.add_argument("--models", nargs="+", choices=list(workloads(False)),
                        help="run only these workloads")
    parser.add_argument("--log-dir", help="keep the tfmp monitor's events here")
    parser.add_argument("--batchnorm-only", action="store_true",
                        help="only the Keras BatchNormalization vs fused line")
    parser.add_argument("--policy", choices=POLICIES, default="auto",
                        help="policy of the Keras mixed and tfmp configurations "
                             "(default: what tfmp's 'auto' picks here)")
    parser.add_argument("--roofline-steps", type=int,
                        help="float32 steps profiled per model for its roofline "
                             "(default 5, quick 2; 0: no roofline, shown as n/a)")
    args = parse_checked(parser, argv)
    if args.roofline_steps is not None and args.roofline_steps < 0:
        parser.error(f"--roofline-steps must be >= 0, got {args.roofline_steps}")
    results = run_suite(args.quick, args.repeats, args.models, args.log_dir,
                        args.batchnorm_only, args.policy, args.roofline_steps)
    print(report.machine_line(results["machine"], results["suite"]["duration_s"]))
    print(f"auto: {results['decision']['policy']}; run: {results['decision']['run']}\n")
    return publish(results, report.markdown(results), args.json)


if __name__ == "__main__":
    main()
