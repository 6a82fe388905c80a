"""A/B runs: train one model under several policies and judge the difference.

The practice this automates: before trusting a mixed policy, train the same model
with the same seed and data under float32 and under the mixed policy, and check
that the final accuracy-like metrics agree within about half a percentage point.
`compare` does this in one process and keeps every number it measured, so the
verdict can be re-judged at another tolerance without training again.

Troubleshooting (accuracy drop versus float32):
docs/troubleshooting.md#accuracy-drop-versus-float32.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
import tensorflow as tf

from tfmp._src.advisors.compare_report import CompareReport, RunResult
from tfmp._src.policy.enable import policy_scope
from tfmp._src.errors import invalid_argument
from tfmp._src.policy.policy import FLOAT32, recommend_policy, resolve_policy

Data = Union[Tuple[Any, Any], tf.data.Dataset]


class _StepTimer(keras.callbacks.Callback):
    """Records the wall time of every training step, in seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.durations: List[float] = []
        self._start = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.durations.append(time.perf_counter() - self._start)


def _fit_arguments(data: Data, name: str, batch_size: int) -> Tuple[dict, int]:
    """Keyword arguments for `Model.fit` and the number of samples per step."""
    if isinstance(data, tf.data.Dataset):
        first = keras.tree.flatten(next(iter(data.take(1))))[0]
        # A dataset brings its own order (shuffle it there, with a seed).
        return {"x": data, "shuffle": False}, int(tf.shape(first)[0])
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return {"x": data[0], "y": data[1], "batch_size": batch_size,
                "shuffle": True}, batch_size
    raise invalid_argument(
        name, data, "a tuple (x, y) of arrays or a batched tf.data.Dataset",
        fix=f"Pass e.g. {name}=(x_train, y_train).")


def _weights_checksum(model: keras.Model) -> float:
    """Sum of |w| over trainable weights: equal across runs when seeding works."""
    return float(sum(np.abs(np.asarray(w.numpy(), dtype="float64")).sum()
                     for w in model.trainable_weights))


def _run_one(
    requested: str,
    policy: str,
    build_model: Callable[[], keras.Model],
    fit_kwargs: dict,
    samples_per_step: int,
    epochs: int,
    seed: int,
) -> RunResult:
    """Builds, checks and trains one model under `policy`; returns what it measured."""
    # policy_scope: the same float32 forcing and optimizer wrapping as tfmp.enable().
    with policy_scope(policy):
        keras.utils.set_random_seed(seed)
        model = build_model()
        if not isinstance(model, keras.Model) or not model.compiled:
            raise invalid_argument(
                "build_model", build_model,
                "a callable returning a compiled keras.Model",
                fix="Call model.compile(optimizer, loss, metrics=...) inside "
                    "build_model before returning the model.")
        checksum = _weights_checksum(model)
        timer = _StepTimer()
        start = time.perf_counter()
        history = model.fit(**fit_kwargs, epochs=epochs, verbose=0,
                            callbacks=[timer])
        wall = time.perf_counter() - start
    del model
    gc.collect()
    # The first step traces and compiles the graph; leave it out of the timing.
    timed = timer.durations[1:] or timer.durations
    step = statistics.median(timed)
    return RunResult(
        requested=requested,
        policy=policy,
        history={k: [float(v) for v in vs] for k, vs in history.history.items()},
        step_time_s=step,
        samples_per_second=samples_per_step / step,
        steps_timed=len(timed),
        wall_time_s=wall,
        initial_weights_checksum=checksum,
    )


def compare(
    build_model: Callable[[], keras.Model],
    train_data: Data,
    val_data: Optional[Data] = None,
    policies: Sequence[str] = (FLOAT32, "auto"),
    epochs: int = 3,
    seed: int = 0,
    batch_size: int = 32,
    tolerance: float = 0.5,
) -> CompareReport:
    """Trains the same model under each policy and reports the differences.

    Each run sets the policy, reseeds (`keras.utils.set_random_seed(seed)`), builds
    the model with `build_model`, and fits it on the same data with the same
    shuffling. Runs happen one after another in this process; the Keras global
    policy is restored afterwards. The Python, NumPy and TensorFlow global random
    generators are left seeded with `seed`.

    Args:
        build_model: Callable with no arguments returning a compiled `keras.Model`.
            It is called once per policy, with that policy already set, so layers
            created inside it take it (give output layers ``dtype="float32"``).
        train_data: Tuple ``(x, y)`` of arrays (batched with `batch_size`) or a
            batched `tf.data.Dataset` yielding ``(x, y)``.
        val_data: Same forms as `train_data`, or None. Gives ``val_*`` metrics.
        policies: Sequence of policy names (or `keras.DTypePolicy`); ``"auto"`` means
            `tfmp.recommend_policy().policy`. Must include ``"float32"`` (the
            baseline) and one more.
        epochs: Int > 0. Epochs per run.
        seed: Int. Seed for weights, dropout and shuffling, the same in every run.
        batch_size: Int > 0. Used when `train_data` is a tuple of arrays.
        tolerance: Float >= 0. Default tolerance of `CompareReport.verdict`, in
            percentage points for accuracy-like metrics (0.5 means 0.5 pp).

    Returns:
        `CompareReport`: final metrics, curves, median time per step (seconds) and
        samples per second for each policy, the largest difference against float32
        and a verdict. ``print(report)`` shows a table, ``report.plot()`` the
        curves, ``report.to_dict()`` everything as plain Python values.

    Raises:
        ValueError: unknown policy name, no float32 baseline, two policies that
            resolve to the same one on this machine (e.g. "auto" is float32 on a
            CPU without bfloat16: there is nothing to compare), bad sizes or data,
            or `build_model` not returning a compiled model.

    Example:
        ``report = tfmp.compare(build, (x, y), (x_val, y_val), epochs=5)`` then
        ``print(report)`` and ``report.verdict(tolerance=0.25)``; tests/
        test_compare.py runs this on scikit-learn's digits.
    """
    for name, value in (("epochs", epochs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid_argument(name, value, "a positive int")
    if not callable(build_model):
        raise invalid_argument("build_model", build_model,
                               "a callable returning a compiled keras.Model")
    distinct = not isinstance(policies, str) and len(set(policies)) == len(policies)
    if not distinct or len(policies) < 2:
        raise invalid_argument(
            "policies", policies, "a sequence of at least two distinct policy names",
            fix="Pass e.g. policies=('float32', 'auto').")
    if not tolerance >= 0:
        raise invalid_argument("tolerance", tolerance, "a float >= 0 (percentage points)")
    resolved = [(getattr(p, "name", p), resolve_policy(p).policy) for p in policies]
    names = [policy for _, policy in resolved]
    if len(set(names)) < len(names):
        raise invalid_argument(
            "policies", policies, "policies that differ on this machine",
            fix="They resolve to " + ", ".join(f"{label!r} -> {policy!r}" for label, policy in resolved)
            + ", so the runs would be the same. 'auto' picks 'float32' where 16-bit compute "
            "is slower; to measure a mixed policy anyway, name it, e.g. "
            "policies=('float32', 'mixed_bfloat16').")
    if FLOAT32 not in names:
        raise invalid_argument(
            "policies", policies, "a sequence including 'float32' as the baseline",
            fix=f"Pass e.g. policies=('float32', {policies[0]!r}).")
    fit_kwargs, samples_per_step = _fit_arguments(train_data, "train_data", batch_size)
    if val_data is not None:
        val_kwargs, _ = _fit_arguments(val_data, "val_data", batch_size)
        fit_kwargs["validation_data"] = (val_kwargs["x"], val_kwargs["y"]) \
            if "y" in val_kwargs else val_kwargs["x"]
    runs = [
        _run_one(requested, policy, build_model, fit_kwargs, samples_per_step,
                 epochs, seed)
        for requested, policy in resolved
    ]
    settings: Dict[str, Any] = dict(epochs=epochs, seed=seed,
                                    samples_per_step=samples_per_step,
                                    device=recommend_policy().device)
    return CompareReport(runs=tuple(runs), tolerance=float(tolerance), settings=settings)
