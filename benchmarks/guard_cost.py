"""What tfmp's non-finite-step guards cost: plain Keras versus each guard, side by side.

    python benchmarks/guard_cost.py                    # full sizes, ~40 min on 2 cores (AVX2 EPYC)
    python benchmarks/guard_cost.py --workloads mlp --policies float32 --repeats 9

Each workload of `benchmarks/workloads.py` (MLP, CNN with BatchNormalization,
Transformer) is trained under each policy in configurations that differ only
in the optimizer: plain Keras (Adam alone) and
`tfmp.LossScaleOptimizer(Adam, loss_scaling=False, guard=...)` with ``"loss"``
(the loss alone: no update waits for the backward pass), ``"batch"`` (tfmp's
default without loss scaling: the loss and every gradient, the batch checked
for the cause), ``"gradients"`` (every gradient) and ``"values"`` (the batch
guard, then every written value, with the step's writes put back on failure).
The price of seeing the backward pass is the ``"batch"`` column over the
``"loss"`` column of the same run. Since 2026-12-03 tfmp's optimizer also runs
Adam's update on TensorFlow's fused kernel
(`tfmp._src.policy.fused_update`, timed alone by ``benchmarks/fused_update.py``),
so each ratio to plain Keras is the guard's cost net of that gain. Each repeat runs one
``fit`` of ``--steps`` steps per configuration, rotating their order, in one
process; a first untimed fit traces each train function. Reported per workload
and policy: the median step time of each configuration, the median over repeats
of the paired ratio (configuration / plain Keras in the same repeat), in wall
and in CPU time of the process, and the ratio of the fastest repeats (each
configuration's minimum / plain Keras's): on a shared virtual machine a whole
``fit`` can take twice its usual wall time with the same CPU time, which no
pairing cancels, while the fastest repeats ran undisturbed. On a CPU without
AVX512_BF16 bfloat16 is emulated (slower than float32); the script prints
whether this one has it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfmp  # noqa: E402
from benchmarks import workloads  # noqa: E402

GUARDS = ("loss", "batch", "gradients", "values")
POLICIES = ("float32", "mixed_bfloat16")
WORKLOADS = ("mlp", "cnn", "transformer")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed fit (default 10)")
    parser.add_argument("--size", choices=("quick", "full"), default="full",
                        help="workload sizes of benchmarks/workloads.py (default full; quick: tests)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--guards", nargs="+", default=list(GUARDS), choices=GUARDS,
                        help="guards timed beside plain Keras (default all four)")
    return parser.parse_args(argv)


def build(config: str, workload: workloads.Workload) -> keras.Model:
    """The workload under the current global policy, compiled for `config`, same weights for all."""
    keras.utils.set_random_seed(0)
    model = workload.build()
    optimizer = keras.optimizers.Adam(1e-4)
    if config != "keras":
        guard = config.split("=")[1]
        optimizer = tfmp.LossScaleOptimizer(optimizer, loss_scaling=False, guard=guard)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def configurations(args: argparse.Namespace) -> Tuple[str, ...]:
    """Plain Keras first, then one configuration per chosen guard."""
    return ("keras",) + tuple(f"guard={guard}" for guard in args.guards)


def measure(workload: workloads.Workload, policy: str, args: argparse.Namespace) -> Dict[str, Dict[str, List[float]]]:
    """Seconds per step of each configuration, one entry per repeat, by clock ("wall", "cpu")."""
    configs = configurations(args)
    dataset = workload.dataset()
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        models = {config: build(config, workload) for config in configs}
    finally:
        keras.config.set_dtype_policy(previous)

    times: Dict[str, Dict[str, List[float]]] = {
        clock: {config: [] for config in configs} for clock in ("wall", "cpu")
    }

    def fit(config: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        models[config].fit(dataset, steps_per_epoch=args.steps, epochs=1, verbose=0)
        times["wall"][config].append((time.perf_counter() - wall) / args.steps)
        times["cpu"][config].append((time.process_time() - cpu) / args.steps)

    for config in configs:
        fit(config)  # traces the train function; not kept
    for clock in times.values():
        for kept in clock.values():
            kept.clear()
    for repeat in range(args.repeats):
        shift = repeat % len(configs)
        for config in configs[shift:] + configs[:shift]:
            fit(config)
    for config in configs[1:]:
        optimizer = models[config].optimizer
        if int(optimizer.overflow_count.numpy()) != 0:
            raise RuntimeError(f"{config}: a timed step of {workload.name} was skipped")
    return times


def paired_ratios(times: Dict[str, List[float]]) -> Dict[str, float]:
    """Median over repeats of each configuration's step time / plain Keras's, same repeat."""
    return {
        config: statistics.median(t / k for t, k in zip(times[config], times["keras"]))
        for config in times if config != "keras"
    }


def fastest_ratios(times: Dict[str, List[float]]) -> Dict[str, float]:
    """Each configuration's fastest step time / plain Keras's fastest, over all repeats."""
    return {f"{config} fastest": min(times[config]) / min(times["keras"])
            for config in times if config != "keras"}


def has_avx512_bf16() -> Optional[bool]:
    """Bool, or None where /proc/cpuinfo cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return "avx512_bf16" in cpuinfo.read()
    except OSError:
        return None


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, float]]:
    args = parse_args(argv)
    chosen = workloads.workloads(quick=args.size == "quick")
    print(f"{args.repeats} repeats of {args.steps} steps, {args.size} sizes; AVX512_BF16: {has_avx512_bf16()}")
    configs = configurations(args)
    guards = configs[1:]
    print(f"{'workload':<13}{'policy':<16}{'clock':<6}{'keras ms':>10}"
          + "".join(f"{c.split('=')[1] + '/keras':>16}" for c in guards)
          + "".join(f"{'fastest ' + c.split('=')[1]:>18}" for c in guards))
    results = {}
    for name in args.workloads:
        for policy in args.policies:
            for clock, times in measure(chosen[name], policy, args).items():
                ratios = {**paired_ratios(times), **fastest_ratios(times)}
                ms = {config: 1000 * statistics.median(times[config]) for config in configs}
                print(f"{name:<13}{policy:<16}{clock:<6}{ms['keras']:>10.1f}"
                      + "".join(f"{ratios[c]:>16.3f}" for c in guards)
                      + "".join(f"{ratios[c + ' fastest']:>18.3f}" for c in guards))
                results[f"{name} {policy} {clock}"] = {**ratios, **{f"{c} ms": m for c, m in ms.items()}}
    return results


if __name__ == "__main__":
    main()
