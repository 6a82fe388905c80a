"""What tfmp's non-finite-step guard costs: plain Keras versus each guard, side by side.

    python benchmarks/guard_cost.py                   # ~1-2 min on 2 CPU cores
    python benchmarks/guard_cost.py --repeats 15 --steps 40 --width 2048 --batch-size 256

An MLP (``--inputs`` -> three Dense(``--width``, relu) -> Dense(10), Adam, batch
``--batch-size``) trained under each policy in three configurations: plain Keras
(Adam alone), `tfmp.LossScaleOptimizer(Adam, loss_scaling=False, guard="loss")`
(tfmp's default without loss scaling: one scalar check of the loss) and the same
with ``guard="gradients"`` (every gradient checked before any update). Only the
optimizer differs, so the ratio is the guard's cost alone. Each repeat runs one
``fit`` of ``--steps`` steps per configuration, rotating their order, in one
process; a first untimed fit traces each train function. Reported per policy:
median step time of each configuration and the median over repeats of the paired
ratio (configuration / plain Keras in the same repeat), in wall time and in CPU
time of the process (less sensitive to other processes on a shared machine; a
guard's waiting, as opposed to its arithmetic, shows only in wall time), and the
ratio of the fastest repeats (each configuration's minimum / plain Keras's): on a
shared virtual machine a whole ``fit`` can take twice its usual wall time with the
same CPU time (seen on a 2-core AMD EPYC: 69 or 129 ms per step at random), which
no pairing cancels, while the fastest repeats all ran undisturbed. The issue's MLP is
1024-2048-2048-2048-10 at batch 256; the defaults are smaller to run in a minute
or two. On a CPU without AVX512_BF16 bfloat16 is emulated (slower than float32);
the script prints whether this one has it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfmp  # noqa: E402

CONFIGS = ("keras", "guard=loss", "guard=gradients")
POLICIES = ("mixed_bfloat16", "float32")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed fit (default 10)")
    parser.add_argument("--inputs", type=int, default=256, help="input features (default 256)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (default 1024)")
    parser.add_argument("--batch-size", type=int, default=128, help="default 128")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    return parser.parse_args(argv)


def build(config: str, args: argparse.Namespace) -> keras.Model:
    """The MLP under the current global policy, compiled for `config`, same weights for all."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((args.inputs,))]
    layers += [keras.layers.Dense(args.width, activation="relu") for _ in range(3)]
    layers.append(keras.layers.Dense(10, dtype="float32"))
    model = keras.Sequential(layers)
    optimizer = keras.optimizers.Adam(1e-4)
    if config != "keras":
        guard = config.split("=")[1]
        optimizer = tfmp.LossScaleOptimizer(optimizer, loss_scaling=False, guard=guard)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def measure(policy: str, args: argparse.Namespace) -> Dict[str, Dict[str, List[float]]]:
    """Seconds per step of each configuration, one entry per repeat, by clock ("wall", "cpu")."""
    rng = np.random.default_rng(0)
    samples = args.steps * args.batch_size
    x = rng.normal(size=(samples, args.inputs)).astype("float32")
    y = rng.integers(0, 10, size=(samples,))
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        models = {config: build(config, args) for config in CONFIGS}
    finally:
        keras.config.set_dtype_policy(previous)

    times: Dict[str, Dict[str, List[float]]] = {
        clock: {config: [] for config in CONFIGS} for clock in ("wall", "cpu")
    }

    def fit(config: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        models[config].fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0)
        times["wall"][config].append((time.perf_counter() - wall) / args.steps)
        times["cpu"][config].append((time.process_time() - cpu) / args.steps)

    for config in CONFIGS:
        fit(config)  # traces the train function; not kept
    for clock in times.values():
        for kept in clock.values():
            kept.clear()
    for repeat in range(args.repeats):
        shift = repeat % len(CONFIGS)
        for config in CONFIGS[shift:] + CONFIGS[:shift]:
            fit(config)
    for config in CONFIGS[1:]:
        optimizer = models[config].optimizer
        assert int(optimizer.overflow_count.numpy()) == 0, "a timed step was skipped"
    return times


def paired_ratios(times: Dict[str, List[float]]) -> Dict[str, float]:
    """Median over repeats of each configuration's step time / plain Keras's, same repeat."""
    return {
        config: statistics.median(t / k for t, k in zip(times[config], times["keras"]))
        for config in CONFIGS[1:]
    }


def fastest_ratios(times: Dict[str, List[float]]) -> Dict[str, float]:
    """Each configuration's fastest step time / plain Keras's fastest, over all repeats."""
    return {f"{config} fastest": min(times[config]) / min(times["keras"]) for config in CONFIGS[1:]}


def has_avx512_bf16() -> Optional[bool]:
    """Bool, or None where /proc/cpuinfo cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return "avx512_bf16" in cpuinfo.read()
    except OSError:
        return None


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, float]]:
    args = parse_args(argv)
    print(
        f"MLP {args.inputs}-{args.width}-{args.width}-{args.width}-10, Adam, batch "
        f"{args.batch_size}; {args.repeats} repeats of {args.steps} steps; "
        f"AVX512_BF16: {has_avx512_bf16()}"
    )
    print(
        f"{'policy':<16}{'clock':<6}{'keras ms':>10}{'loss ms':>10}{'grads ms':>10}"
        f"{'loss/keras':>12}{'grads/keras':>13}{'fastest: loss':>15}{'grads':>7}"
    )
    results = {}
    for policy in args.policies:
        for clock, times in measure(policy, args).items():
            ratios = {**paired_ratios(times), **fastest_ratios(times)}
            ms = [1000 * statistics.median(times[config]) for config in CONFIGS]
            print(
                f"{policy:<16}{clock:<6}{ms[0]:>10.1f}{ms[1]:>10.1f}{ms[2]:>10.1f}"
                f"{ratios['guard=loss']:>12.3f}{ratios['guard=gradients']:>13.3f}"
                f"{ratios['guard=loss fastest']:>15.3f}{ratios['guard=gradients fastest']:>7.3f}"
            )
            results[f"{policy} {clock}"] = {**ratios, **{f"{c} ms": m for c, m in zip(CONFIGS, ms)}}
    return results


if __name__ == "__main__":
    main()
