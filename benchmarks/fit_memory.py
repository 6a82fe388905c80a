"""Do repeated `fit` calls leak? Process memory growth per `fit` call, per configuration.

    python benchmarks/fit_memory.py                  # 12 fits of 128 steps each
    python benchmarks/fit_memory.py --fits 30 --json fit_memory.json
    python benchmarks/fit_memory.py --configs keras monitor_grad_stats
    python benchmarks/fit_memory.py --model tiny --data dataset --fits 100 --steps 4 --batch-size 8

One model per configuration, trained by `--fits` calls of ``model.fit(x, y,
epochs=1)`` (or of ``model.fit(dataset)``) of `--steps` steps each, with a new
callback instance per call (as a notebook or a script with a loop over `fit`
does). Models: ``mlp`` (32 -> 64 -> 64 -> 10, softmax cross-entropy, Adam) or
``tiny`` (4 -> 8 -> 1, mean squared error, SGD: the model of
tests/test_monitor.py's repeated-fit test). Configurations, all under the same
`--policy`:

- ``keras``: plain Keras, `keras.callbacks.TensorBoard(update_freq=...)` (the
  reference: what Keras itself costs per `fit` call);
- ``monitor``: `tfmp.enable(policy)`, `tfmp.LossScaleMonitor(update_freq=...)`;
- ``monitor_grad_stats``: the same with ``grad_stats_freq=10``;
- ``check_numerics``: `tfmp.enable(policy, debug=True)` (`tfmp.check_numerics`
  on every layer), no callback;
- ``all``: `tfmp.enable(policy, debug=True)` and the monitor with gradient
  statistics.

Each configuration runs in a Python process of its own (by default), so that
what one leaves behind is not counted against the next. After each call the
script runs `gc.collect()` and reads two measures:

- RSS, the resident set size (psutil, else ``/proc/self/statm``): what the
  system sees. It misses growth that fills memory the allocator had already
  taken and freed, and it jumps when the allocator takes or returns a block.
- heap in use: bytes handed out by glibc's malloc and not freed
  (``mallinfo2()``: ``uordblks + hblkhd``), where glibc >= 2.33 provides it. It
  counts every live allocation of C, C++ (TensorFlow) and Python code, whatever
  the free memory around it; "n/a" elsewhere.

Growth per `fit` is measured over the last half of the calls (the first ones
trace the step, open files and fill caches), as the Theil-Sen slope of their
readings (`growth_per_call`). With few calls (the default 12), a jump of RSS
still moves its slope by tens of KiB per call: take 30 or more calls to tell a
few KiB per call from nothing. Also reported: how many times the train step was
traced (`train_step` runs only while `tf.function` traces it: Keras traces it
twice in the first call) and whether ``model.train_function`` is still the
object of the first call.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tfmp

CONFIGS = ("keras", "monitor", "monitor_grad_stats", "check_numerics", "all")
_MIB = 2.0**20


def rss_bytes() -> int:
    """Resident set size of this process, in bytes (psutil, else /proc/self/statm)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                     "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _mallinfo2() -> Optional[Any]:
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        function = ctypes.CDLL(library).mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> Optional[int]:
    """Bytes of malloc's heap in use (glibc's ``mallinfo2``), or None without it.

    ``uordblks`` (allocated chunks in every arena) plus ``hblkhd`` (blocks
    allocated with mmap): every live malloc allocation of this process.
    """
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def slope(readings: Sequence[float]) -> float:
    """Theil-Sen slope of `readings` (one per call), in their unit per call.

    The median, over every pair of readings, of their difference divided by the
    calls between them: a jump of RSS between two calls (the allocator taking or
    returning a block) shifts a first-to-last difference but hardly this median.

    Raises:
        ValueError: fewer than 2 readings.
    """
    count = len(readings)
    if count < 2:
        raise ValueError(f"slope needs at least 2 readings, got {count}.")
    return statistics.median(
        (readings[j] - readings[i]) / (j - i) for i in range(count) for j in range(i + 1, count)
    )


def growth_per_call(readings: Sequence[float]) -> float:
    """Growth per call over the last half of `readings` (one per call): their `slope`.

    Raises:
        ValueError: fewer than 4 readings.
    """
    if len(readings) < 4:
        raise ValueError(f"growth_per_call needs at least 4 readings, got {len(readings)}.")
    return slope(readings[len(readings) // 2 :])


def counting_model(keras: Any, name: str = "mlp") -> tuple:
    """The model `name` ("mlp" or "tiny"), counting how often its train step is traced.

    Args:
        keras: The `keras` module (imported by the caller, after TF_CPP_MIN_LOG_LEVEL).
        name: ``"mlp"`` (32 -> 64 -> 64 -> 10) or ``"tiny"`` (4 -> 8 -> 1).

    Returns:
        Tuple (uncompiled `keras.Sequential` subclass instance, number of input
        features, loss). ``type(model).traces`` counts the traces.
    """

    class CountingModel(keras.Sequential):
        traces = 0

        def train_step(self, data):
            type(self).traces += 1  # in graph mode: once per trace
            return super().train_step(data)

    if name == "tiny":
        layers, features, loss = [keras.layers.Dense(8), keras.layers.Dense(1)], 4, "mse"
    else:
        layers = [
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
        features, loss = 32, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return CountingModel([keras.Input((features,)), *layers]), features, loss


def measure(
    config: str,
    fits: int,
    steps: int,
    batch_size: int,
    policy: str,
    model_name: str = "mlp",
    data: str = "arrays",
    update_freq: Union[int, str] = 1,
) -> Dict[str, Any]:
    """Runs `fits` fit calls of one configuration in this process; returns its readings.

    Returns:
        Dict: ``rss_mib`` and ``heap_mib`` (lists of floats, after each call, MiB;
        ``heap_mib`` None without mallinfo2), ``traces`` (int), ``same_train_function``
        (bool), ``policy`` (str), ``seconds`` (float, median per call).

    Raises:
        ValueError: `config` is not one of `CONFIGS`.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmp

    if config not in CONFIGS:
        raise ValueError(f"Unknown configuration {config!r}; known: {', '.join(CONFIGS)}.")
    log_root = tempfile.mkdtemp(prefix="tfmp_fit_memory_")
    policy_before = keras.config.dtype_policy()
    if config == "keras":
        keras.config.set_dtype_policy(policy)
    else:
        tfmp.enable(policy, debug=config in ("check_numerics", "all"))
    try:
        model, features, loss = counting_model(keras, model_name)
        model.compile("sgd" if model_name == "tiny" else "adam", loss)
    finally:
        if config != "keras":
            tfmp.disable()
        keras.config.set_dtype_policy(policy_before)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * batch_size, features)).astype("float32")
    y = rng.integers(0, 10, steps * batch_size) if model_name == "mlp" else x[:, :1] * 2.0
    inputs = {"x": x, "y": y, "batch_size": batch_size}
    if data == "dataset":
        inputs = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)}

    rss: List[float] = []
    heap: List[float] = []
    seconds: List[float] = []
    first_function = None
    same = True
    for index in range(fits):
        log_dir = os.path.join(log_root, str(index))
        if config == "keras":
            callbacks = [keras.callbacks.TensorBoard(log_dir, update_freq=update_freq)]
        elif config == "monitor":
            callbacks = [tfmp.LossScaleMonitor(log_dir, update_freq=update_freq)]
        elif config in ("monitor_grad_stats", "all"):
            callbacks = [tfmp.LossScaleMonitor(log_dir, update_freq=update_freq, grad_stats_freq=10)]
        else:
            callbacks = []
        start = time.perf_counter()
        model.fit(**inputs, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        seconds.append(time.perf_counter() - start)
        if first_function is None:
            first_function = model.train_function
        same = same and model.train_function is first_function
        del callbacks
        gc.collect()
        rss.append(rss_bytes() / _MIB)
        in_use = heap_bytes()
        if in_use is not None:
            heap.append(in_use / _MIB)
    return {
        "rss_mib": rss,
        "heap_mib": heap or None,
        "traces": type(model).traces,
        "same_train_function": same,
        "policy": model.dtype_policy.name,
        "seconds": statistics.median(seconds),
    }


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=12, help="fit calls per configuration (default 12, at least 6)")
    parser.add_argument("--steps", type=int, default=128, help="steps per fit call (default 128)")
    parser.add_argument("--batch-size", type=int, default=32, help="default 32")
    parser.add_argument(
        "--policy", default="mixed_float16",
        help="dtype policy of every configuration (default mixed_float16: dynamic loss scaling)",
    )
    parser.add_argument("--model", choices=("mlp", "tiny"), default="mlp", help="default mlp")
    parser.add_argument(
        "--data", choices=("arrays", "dataset"), default="arrays",
        help="NumPy arrays given to every call (default) or one tf.data.Dataset reused by every call",
    )
    parser.add_argument(
        "--update-freq", default="1",
        help="update_freq of the TensorBoard callback and of the monitor: 'epoch' or N batches (default 1)",
    )
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="default: all")
    parser.add_argument(
        "--in-process", action="store_true",
        help="run the configurations one after the other in this process (default: one process each)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every reading to this JSON file")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # child process: print JSON
    args = parser.parse_args(argv)
    if args.update_freq != "epoch":
        if not args.update_freq.isdigit() or int(args.update_freq) < 1:
            parser.error(f"--update-freq must be 'epoch' or a positive int, got {args.update_freq!r}")
        args.update_freq = int(args.update_freq)
    if args.fits < 6:
        parser.error(f"--fits must be at least 6 (growth is measured over the last half), got {args.fits}")
    return args


def _run_child(config: str, args: argparse.Namespace) -> Dict[str, Any]:
    command = [
        sys.executable, os.path.abspath(__file__), "--one", config,
        "--fits", str(args.fits), "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--policy", args.policy,
        "--model", args.model, "--data", args.data, "--update-freq", str(args.update_freq),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"configuration {config} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _kib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{1024 * value:.1f}"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, Any]]:
    """Measures each configuration and prints the table.

    Returns:
        Dict from configuration to its results (see `measure`) plus
        ``rss_growth_mib_per_fit`` and ``heap_growth_mib_per_fit`` (floats; the
        latter None without mallinfo2).
    """
    args = parse_args(argv)
    options = (args.fits, args.steps, args.batch_size, args.policy, args.model, args.data, args.update_freq)
    if args.one:
        print(json.dumps(measure(args.one, *options)))
        return {}
    results = {}
    for config in args.configs:
        result = measure(config, *options) if args.in_process else _run_child(config, args)
        result["rss_growth_mib_per_fit"] = growth_per_call(result["rss_mib"])
        heap = result["heap_mib"]
        result["heap_growth_mib_per_fit"] = growth_per_call(heap) if heap else None
        results[config] = result
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            arguments = {key: value for key, value in vars(args).items() if key != "one"}
            json.dump({"arguments": arguments, "results": results}, out, indent=1)
    print(
        f"Memory growth per fit call: model {args.model}, {args.fits} fits of {args.steps} steps "
        f"(batch {args.batch_size}, {args.data}), policy {args.policy}, update_freq "
        f"{args.update_freq}; slope over the last {args.fits - args.fits // 2} calls; "
        f"{'one process' if args.in_process else 'one process per configuration'}"
    )
    print("| configuration | RSS KiB per fit | heap KiB per fit | RSS after first fit MiB | RSS at end MiB "
          "| traces | same train_function | s per fit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for config, result in results.items():
        rss = result["rss_mib"]
        print(
            f"| {config} | {_kib(result['rss_growth_mib_per_fit'])} | "
            f"{_kib(result['heap_growth_mib_per_fit'])} | {rss[0]:.1f} | {rss[-1]:.1f} | "
            f"{result['traces']} | {result['same_train_function']} | {result['seconds']:.2f} |"
        )
    return results


if __name__ == "__main__":
    main()
