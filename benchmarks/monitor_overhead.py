"""What `tfmp.LossScaleMonitor` costs: `fit` with it versus without, side by side.

    python benchmarks/monitor_overhead.py               # 9 rounds of 300-step fits
    python benchmarks/monitor_overhead.py --rounds 15 --steps 500

One model (the main job's digits classifier, `examples/train_digits.py`, under
`tfmp.enable("auto")`), trained by whole `model.fit` calls of `--steps` steps in
three configurations: no monitor, a monitor with ``update_freq=100`` and one with
``update_freq="batch"``. Each round runs the three in turn, rotating their order
so that no configuration always follows another; a shared machine's background
load then falls on each alike. Each timed call includes everything the monitor
adds (its begin and end of training, logging points, the crash guard); the
configuration without a monitor runs the train function exactly as it was before
any monitor wrapped it. A first untimed call per configuration traces the train
function. Reported: the median seconds per call of each configuration and the
ratio of medians to the configuration without a monitor (target for
``update_freq=100``: at most 1.02, issue 6), plus the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import tfmp  # noqa: E402
import train_digits  # noqa: E402

CONFIGS = ("without", "update_freq=100", 'update_freq="batch"')
_FREQ = {"update_freq=100": 100, 'update_freq="batch"': "batch"}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=9, help="timed rounds (default 9)"
    )
    parser.add_argument(
        "--steps", type=int, default=300, help="steps per fit call (default 300)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="default 32")
    return parser.parse_args(argv)


def build(batch_size: int) -> tuple:
    """The digits classifier compiled under tfmp's automatic policy, and its data."""
    (x, y), _ = train_digits.load_digits_arrays()
    data = tf.data.Dataset.from_tensor_slices((x, y)).cache().repeat()
    data = data.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    decision = tfmp.enable("auto")
    try:
        model = train_digits.build_model(x.shape[1:])
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss="sparse_categorical_crossentropy",
        )
    finally:
        tfmp.disable()
    return model, data, decision.policy


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Runs the benchmark and prints its table.

    Returns:
        Dict from configuration to its ratio of medians (1.0 for "without").
    """
    args = parse_args(argv)
    model, data, policy = build(args.batch_size)
    log_root = tempfile.mkdtemp(prefix="tfmp_monitor_overhead_")
    model.fit(data, steps_per_epoch=args.steps, shuffle=False, verbose=0)  # traces
    pristine = model.train_function  # as before any monitor wrapped it
    times: Dict[str, List[float]] = {config: [] for config in CONFIGS}

    def timed_fit(config: str, index: int) -> float:
        model.train_function = pristine
        callbacks = []
        if config != "without":
            log_dir = os.path.join(log_root, f"{index}_{_FREQ[config]}")
            callbacks.append(tfmp.LossScaleMonitor(log_dir, update_freq=_FREQ[config]))
        start = time.perf_counter()
        model.fit(
            data,
            steps_per_epoch=args.steps,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        return time.perf_counter() - start

    for config in CONFIGS[1:]:
        timed_fit(config, -1)  # warm-up: first monitor, first file in the run
    for index in range(args.rounds):
        shift = index % len(CONFIGS)
        for config in CONFIGS[shift:] + CONFIGS[:shift]:
            times[config].append(timed_fit(config, index))

    base = statistics.median(times["without"])
    print(
        f"LossScaleMonitor overhead: digits classifier, policy {policy}, batch "
        f"{args.batch_size}, {args.steps} steps per fit, {args.rounds} rounds "
        f"(alternating, rotated), {os.cpu_count()} CPU cores, "
        f"GPUs: {len(tf.config.list_physical_devices('GPU'))}"
    )
    ratios = {}
    for config in CONFIGS:
        median = statistics.median(times[config])
        ratios[config] = median / base
        paired = statistics.median(
            t / b for t, b in zip(times[config], times["without"])
        )
        print(
            f"  {config:22s} median {median:7.3f} s per fit "
            f"({1000 * median / args.steps:6.3f} ms/step)  ratio {ratios[config]:.4f}"
            f"  (median of per-round ratios {paired:.4f})"
        )
    print(
        f"overhead ratio at update_freq=100: {ratios['update_freq=100']:.4f} "
        f"(target <= 1.02)"
    )
    return ratios


if __name__ == "__main__":
    main()
