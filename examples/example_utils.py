"""Helpers shared by the example scripts and the notebooks.

Every script in this folder takes the same training options
(`example_args.add_training_args`, parsed before TensorFlow is imported) and runs
the same job around its own data and model (`train_and_evaluate`): enable tfmp,
build and compile the model, fit it with `tfmp.LossScaleMonitor`, evaluate, and
restore the previous policy. Every run logs to a new folder of its own
(`new_run_dir`), so a second run never mixes its events with the first's. The
notebooks read the monitor's TensorBoard event files back with `read_scalars` and
`overflow_steps`.

The notebooks import this module from ``../examples``; the test suite, which runs
them in a temporary folder, points the environment variable ``TFMP_EXAMPLES`` at
this folder instead.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from typing import Callable, Optional, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402

import tfmp  # noqa: E402


def train_and_evaluate(
    args: argparse.Namespace,
    make_datasets: Callable[[], Tuple[tf.data.Dataset, tf.data.Dataset]],
    build_model: Callable[[Sequence[int]], keras.Model],
    *,
    learning_rate: float = 1e-3,
    loss: str = "sparse_categorical_crossentropy",
    loss_scale_options: Optional[dict] = None,
    grad_stats_freq: Optional[int] = None,
) -> float:
    """Trains and evaluates one model under tfmp; returns its test accuracy.

    The policy is enabled before the model is built (layers take the global policy
    when they are created) and disabled afterwards, also when training raises.

    Args:
        args: Namespace with the options of `example_args.add_training_args`.
        make_datasets: Callable returning batched ``(train, test)`` datasets of
            ``(features, label)``; called after `tfmp.enable()`.
        build_model: Callable taking the feature shape without the batch axis and
            returning an uncompiled `keras.Model`.
        learning_rate: Float. Adam's learning rate.
        loss: String. A Keras loss name.
        loss_scale_options: Dict or None. `tfmp.enable`'s `loss_scale_options`
            (with them a float32 model also gets `tfmp.LossScaleOptimizer`, which
            skips and counts non-finite steps at a fixed scale of 1). Settings
            such as ``initial_scale`` are meant for the float16 run: they are
            passed with ``loss_scaling`` said explicitly (True under
            ``mixed_float16`` only), so bfloat16 and float32 runs keep the fixed
            scale without `tfmp.LossScaleWarning`.
        grad_stats_freq: Int or None. The monitor's `grad_stats_freq`: gradient
            norm and update ratio every N steps.

    Returns:
        Float in [0, 1]: the test accuracy.
    """
    keras.utils.set_random_seed(args.seed)
    if loss_scale_options:
        policy = tfmp.recommend_policy().policy if args.policy == "auto" else args.policy
        loss_scale_options = {"loss_scaling": policy == "mixed_float16", **loss_scale_options}
    decision = tfmp.enable(args.policy, loss_scale_options=loss_scale_options)
    try:
        print(decision)
        train, test = make_datasets()
        model = build_model(train.element_spec[0].shape[1:])
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate),
            loss=loss,
            metrics=["accuracy"],
        )
        run_dir = new_run_dir(args.log_dir)
        monitor = tfmp.LossScaleMonitor(
            run_dir, update_freq="batch", grad_stats_freq=grad_stats_freq
        )
        # shuffle=False: the tf.data pipelines reshuffle every epoch themselves.
        model.fit(
            train,
            epochs=args.epochs,
            steps_per_epoch=args.steps,
            shuffle=False,
            callbacks=[monitor],
        )
        _, accuracy = model.evaluate(test, verbose=0)
    finally:
        tfmp.disable()
    print(f"Test accuracy ({decision.policy}): {accuracy:.4f}")
    print(f"TensorBoard logs: tensorboard --logdir {args.log_dir} (this run: {run_dir})")
    return float(accuracy)


def new_run_dir(root: str) -> str:
    """Creates a new, empty run folder below `root` and returns its path.

    The folder is named after the local date and time, ``<root>/YYYYmmdd-HHMMSS``;
    a later run in the same second gets ``-2``, ``-3``, ... appended. Each run's
    event files then stay apart: ``tensorboard --logdir <root>`` lists every run
    separately, and `read_scalars` on the returned folder reads this run only
    (event files of two runs in one folder would be read back as one series whose
    steps restart in the middle).

    Args:
        root: String or path-like. Parent folder, created if missing.

    Returns:
        String: the new folder, ``os.path.join(root, name)`` (relative when `root` is).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for number in itertools.count(1):
        path = os.path.join(os.fspath(root), stamp if number == 1 else f"{stamp}-{number}")
        try:
            os.makedirs(path)  # not exist_ok: a folder that exists belongs to another run
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable: itertools.count() does not end")


def read_scalars(
    log_dir: str, tag: str, subdir: Optional[str] = "train"
) -> Tuple[np.ndarray, np.ndarray]:
    """Reads one scalar series back from TensorBoard event files.

    `tf.summary.scalar` (which `tfmp.LossScaleMonitor` uses) stores scalars as
    tensors, so they are read with TensorBoard's own `EventAccumulator`.

    Args:
        log_dir: String. The run's root folder (the monitor's `log_dir`).
        tag: String. E.g. ``"precision/batch_loss_scale"`` or ``"precision/epoch_overflow_count"``.
        subdir: String or None. Folder below `log_dir` holding the event files.

    Returns:
        ``(steps, values)``: int64 and float64 arrays of equal length, in the order
        written (files sorted by name, i.e. by creation time). Empty when the tag
        is absent.
    """
    folder = os.path.join(log_dir, subdir) if subdir else log_dir
    steps, values = [], []
    for path in sorted(tf.io.gfile.glob(os.path.join(folder, "events.out.tfevents.*"))):
        accumulator = event_accumulator.EventAccumulator(
            path, size_guidance={event_accumulator.TENSORS: 0}
        )
        accumulator.Reload()
        if tag in accumulator.Tags()["tensors"]:
            for event in accumulator.Tensors(tag):
                steps.append(event.step)
                values.append(float(tf.make_ndarray(event.tensor_proto)))
    return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)


def overflow_steps(steps: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Steps at which a cumulative overflow count went up: the skipped steps.

    Args:
        steps: Int array. Logged steps, e.g. from `read_scalars`.
        counts: Number array. The cumulative ``overflow_count`` at those steps.

    Returns:
        Int64 array of the steps whose count exceeds the previous one (the first
        step counts when its count is above zero).
    """
    counts = np.asarray(counts)
    rises = np.diff(np.concatenate([[0], counts])) > 0
    return np.asarray(steps, dtype=np.int64)[rises]
