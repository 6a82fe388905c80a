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
``update_freq=100``: at most 1.02, issue 6), in wall time and in CPU time of the
process, and the time spent inside the monitor's own hooks.
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


class TimedMonitor(tfmp.LossScaleMonitor):
    """`tfmp.LossScaleMonitor` that adds up the wall time spent in its hooks.

    Attributes:
        inside: Float, seconds spent in the monitor's callback methods (reads,
            event writes, crash-guard installation) since construction.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.inside = 0.0


def _timed(name: str):
    hook = getattr(tfmp.LossScaleMonitor, name)

    def timed_hook(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self.inside += time.perf_counter() - start

    return timed_hook


for _hook in (
    "on_train_begin",
    "on_epoch_begin",
    "on_train_batch_end",
    "on_test_begin",
    "on_epoch_end",
    "on_train_end",
):
    setattr(TimedMonitor, _hook, _timed(_hook))


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Runs the benchmark and prints its table.

    Three measures per configuration, medians over rounds: wall time per `fit`
    call; CPU time of the process per call (`time.process_time`, all threads),
    less disturbed by other processes on a shared machine; and, for monitored
    calls, the wall time spent inside the monitor's hooks, which bounds what
    the monitor adds on the Python side whatever the background load.

    Returns:
        Dict from configuration to its ratio of median wall times (1.0 for
        "without").
    """
    args = parse_args(argv)
    model, data, policy = build(args.batch_size)
    log_root = tempfile.mkdtemp(prefix="tfmp_monitor_overhead_")
    model.fit(data, steps_per_epoch=args.steps, shuffle=False, verbose=0)  # traces
    pristine = model.train_function  # as before any monitor wrapped it
    wall: Dict[str, List[float]] = {config: [] for config in CONFIGS}
    cpu: Dict[str, List[float]] = {config: [] for config in CONFIGS}
    inside: Dict[str, List[float]] = {config: [] for config in CONFIGS}

    def timed_fit(config: str, index: int) -> None:
        model.train_function = pristine
        callbacks = []
        if config != "without":
            log_dir = os.path.join(log_root, f"{index}_{_FREQ[config]}")
            callbacks.append(TimedMonitor(log_dir, update_freq=_FREQ[config]))
        start, start_cpu = time.perf_counter(), time.process_time()
        model.fit(
            data,
            steps_per_epoch=args.steps,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        if index >= 0:
            wall[config].append(time.perf_counter() - start)
            cpu[config].append(time.process_time() - start_cpu)
            inside[config].append(callbacks[0].inside if callbacks else 0.0)

    for config in CONFIGS[1:]:
        timed_fit(config, -1)  # warm-up: first monitor, first file in the run
    for index in range(args.rounds):
        shift = index % len(CONFIGS)
        for config in CONFIGS[shift:] + CONFIGS[:shift]:
            timed_fit(config, index)

    print(
        f"LossScaleMonitor overhead: digits classifier, policy {policy}, batch "
        f"{args.batch_size}, {args.steps} steps per fit, {args.rounds} rounds "
        f"(alternating, rotated), {os.cpu_count()} CPU cores, "
        f"GPUs: {len(tf.config.list_physical_devices('GPU'))}"
    )
    base_wall, base_cpu = _median(wall["without"]), _median(cpu["without"])
    ratios = {}
    for config in CONFIGS:
        ratios[config] = _median(wall[config]) / base_wall
        in_monitor = _median(inside[config])
        print(
            f"  {config:20s} wall {_median(wall[config]):6.3f} s/fit "
            f"ratio {ratios[config]:.4f} | CPU {_median(cpu[config]):6.3f} s/fit "
            f"ratio {_median(cpu[config]) / base_cpu:.4f} | inside the monitor "
            f"{1000 * in_monitor:7.2f} ms/fit = {100 * in_monitor / base_wall:.3f}% "
            f"({1e6 * in_monitor / args.steps:.1f} us/step)"
        )
    print(
        f"overhead ratio at update_freq=100: wall {ratios['update_freq=100']:.4f}, "
        f"CPU {_median(cpu['update_freq=100']) / base_cpu:.4f}, monitor's own time "
        f"{1 + _median(inside['update_freq=100']) / base_wall:.4f} (target <= 1.02)"
    )
    return ratios


if __name__ == "__main__":
    main()
