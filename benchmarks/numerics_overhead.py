"""Train-step time with tfmp.check_numerics hooks versus none, measured side by side.

Two models on scikit-learn's bundled digits (1,797 real 8x8 images, no network): an
MLP on the 64 pixels and a small CNN on the 8x8x1 images. Each model gets three
train functions, traced once each: no hooks, every layer checked (`phase="both"`),
and the loss-and-gradients-only mode (`phase="backward"`). All three run on the same
model, optimizer and batches, in interleaved rounds whose order rotates, so machine
load hits them alike. Printed: the median time per step of each, and the median of
its per-round ratios to no hooks. Targets (issue 5): at most 1.5x with every layer
checked, at most 1.05x for loss and gradients only.

Run: `PYTHONPATH=. python benchmarks/numerics_overhead.py [--steps 50] [--rounds 11]`.
Benchmarks are not unit tests: numbers vary with the machine and its load. One TF
thread by default, so that on a shared machine the ratio reflects the work added
rather than thread scheduling (`--threads 0` for TensorFlow's default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfmp  # noqa: E402

MODES = {"none": None, "all layers": "both", "loss+gradients": "backward"}


def _mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="digits_mlp",
    )


def _cnn() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="digits_cnn",
    )


def _batches(images: bool, batch_size: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """The digits as a list of (x, y) batches of tensors, made once.

    Steps call the train function on these directly: a `tf.data` iterator adds
    thread hand-offs whose latency, on a loaded machine, varies by more than the
    hooks cost.
    """
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    if images:
        x = x.reshape(-1, 8, 8, 1)
    return [
        (tf.constant(x[start : start + batch_size]), tf.constant(digits.target[start : start + batch_size]))
        for start in range(0, len(x) - batch_size + 1, batch_size)
    ]


def _train_functions(build: Callable[[], keras.Model], batches: list) -> dict[str, Callable]:
    """One model, its train function built and traced once per mode.

    Separate copies of a model differ in speed among themselves by more than the
    hooks cost (kernel and memory placement), so one model serves all modes: the
    hooks go in, the train function is built (with its per-step check) and traced,
    and the hooks come out again; the traced function keeps them.
    """
    keras.utils.set_random_seed(0)
    model = build()
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    functions = {}
    for mode, phase in MODES.items():
        handle = tfmp.check_numerics(model, phase=phase) if phase else None
        model.make_train_function()
        functions[mode] = model.train_function
        for batch in batches[:3]:  # trace and warm up while the hooks are in
            functions[mode]([batch])
        if handle is not None:
            handle.remove()
        model.train_function = None
    return functions


def _time_per_step(functions: dict[str, Callable], batches: list, steps: int, rounds: int) -> dict:
    """Per mode: (median seconds per step, median of the per-round ratios to no hooks)."""
    modes = list(functions)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for index in range(rounds):
        for mode in modes[index % len(modes) :] + modes[: index % len(modes)]:
            start = time.perf_counter()
            for step in range(steps):
                functions[mode]([batches[step % len(batches)]])
            times[mode].append((time.perf_counter() - start) / steps)
    return {
        mode: (statistics.median(values), statistics.median(v / b for v, b in zip(values, times["none"])))
        for mode, values in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="train steps per round and mode")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds; medians are reported")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="TF intra- and inter-op threads (0: TF's default)")
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    print(
        f"policy {keras.config.dtype_policy().name}, {args.rounds} rounds x {args.steps} steps, "
        f"batch {args.batch_size}, threads {args.threads or 'default'}"
    )
    for name, build, images in (("digits MLP", _mlp, False), ("small CNN", _cnn, True)):
        batches = _batches(images, args.batch_size)
        per_step = _time_per_step(_train_functions(build, batches), batches, args.steps, args.rounds)
        for mode, (seconds, ratio) in per_step.items():
            print(f"{name:<11} {mode:<15} {seconds * 1e3:8.3f} ms/step  ratio {ratio:5.2f}x")


if __name__ == "__main__":
    main()
