"""`tfmp.compare`: train one model under float32 and a mixed policy, and judge the difference.

Practitioners check that the same model, seed and data reach final accuracy-like metrics
within about half a percentage point of float32. One run per policy judges noise as often
as precision, so each policy runs with several seeds and the paired differences' interval
is judged (compare_stats.py). The trained models are timed in rotating turns, so a busy
moment of a shared machine falls on every policy alike.
"""

from __future__ import annotations

import gc
import inspect
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
import tensorflow as tf

from tfmp._src.advisors import compare_stats
from tfmp._src.advisors.compare_report import CompareReport, RunResult
from tfmp._src.advisors.compare_stats import MAX_SEEDS
from tfmp._src.errors import invalid_argument
from tfmp._src.policy.enable import policy_scope
from tfmp._src.policy.policy import FLOAT32, recommend_policy, resolve_policy

Data = Union[Tuple[Any, Any], tf.data.Dataset]
TIMING_STEPS = 10  # steps per timed call (fewer when an epoch has fewer)


def _fit_arguments(data: Data, name: str, batch_size: int) -> Tuple[dict, int]:
    """`Model.fit` keyword arguments and samples per step, once `data` is checked (before any training)."""
    if isinstance(data, tf.data.Dataset):
        first = next(iter(data.take(1)), None)
        if first is None:
            raise invalid_argument(name, data, "a tf.data.Dataset that yields at least one batch",
                                   fix="It is empty; check its source and filters.")
        # A dataset brings its own order (shuffle it there, with a seed).
        return {"x": data, "shuffle": False}, int(tf.shape(keras.tree.flatten(first)[0])[0])
    if isinstance(data, (tuple, list)) and len(data) == 2 and _same_rows(data):
        return {"x": data[0], "y": data[1], "batch_size": batch_size,
                "shuffle": True}, batch_size
    raise invalid_argument(
        name, data, "a tuple (x, y) of arrays or a batched tf.data.Dataset",
        fix=f"Pass e.g. {name}=(x_train, y_train): arrays of numbers with one row per example, "
        "as many rows in x as in y.")


def _same_rows(data: Sequence[Any]) -> bool:
    """True when every array of x and y holds numbers and the same number (>= 1) of rows."""
    try:
        leaves = [np.asarray(leaf) for leaf in keras.tree.flatten(list(data))]
    except (ValueError, TypeError):
        return False
    numeric = all(leaf.dtype.kind in "biuf" and leaf.ndim >= 1 for leaf in leaves)
    return bool(leaves) and numeric and len({len(leaf) for leaf in leaves}) == 1 and len(leaves[0]) >= 1


class StepTimer(keras.callbacks.Callback):
    """Records the wall time of every training step in `durations` (seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.durations: List[float] = []
        self._start = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.durations.append(time.perf_counter() - self._start)


def timing_kwargs(fit_kwargs: dict, samples_per_step: int, steps: int) -> dict:
    """`fit` keyword arguments for `steps` full batches from the start of the data."""
    if "y" in fit_kwargs:
        n = samples_per_step * steps
        return dict(fit_kwargs, x=keras.tree.map_structure(lambda a: a[:n], fit_kwargs["x"]),
                    y=keras.tree.map_structure(lambda a: a[:n], fit_kwargs["y"]),
                    shuffle=False)
    return dict(fit_kwargs, x=fit_kwargs["x"].take(steps))


def time_alternately(
    models: Dict[str, keras.Model], fit_kwargs: dict, rounds: int
) -> Dict[str, Dict[str, Any]]:
    """Times trained models (already traced) in rotating turns; the first label is the reference.

    Returns:
        Dict of label to ``{"step_time_s", "ratio", "seconds", "ratios"}``: per round
        the mean seconds per step and the paired ratio (reference seconds / this
        policy's, > 1: faster); `step_time_s` and `ratio` are their medians.
    """
    labels = list(models)
    seconds: Dict[str, List[float]] = {label: [] for label in labels}
    kwargs = {k: v for k, v in fit_kwargs.items() if k != "validation_data"}
    for r in range(rounds):
        turn = r % len(labels)
        for label in labels[turn:] + labels[:turn]:
            timer = StepTimer()
            models[label].fit(**kwargs, epochs=1, verbose=0, callbacks=[timer])
            seconds[label].append(sum(timer.durations) / len(timer.durations))
    reference = seconds[labels[0]]
    out = {}
    for label in labels:
        ratios = [ref / own for ref, own in zip(reference, seconds[label])]
        out[label] = {"step_time_s": statistics.median(seconds[label]),
                      "ratio": statistics.median(ratios),
                      "seconds": seconds[label], "ratios": ratios}
    return out


def _as_classes(y: Any) -> Optional[np.ndarray]:
    """Integer class labels from int labels (n,) / (n, 1) or one-hot (n, k)."""
    if not isinstance(y, (np.ndarray, tf.Tensor)):
        return None
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] > 1:
        return np.argmax(y, axis=1)
    if y.ndim in (1, 2) and np.issubdtype(y.dtype, np.integer):
        return y.reshape(-1).astype("int64")
    return None


def class_labels(val_data: Any) -> Optional[np.ndarray]:
    """Validation class labels (1-D int64), or None when they are not single-output classes."""
    if isinstance(val_data, tf.data.Dataset):
        parts = []
        for element in val_data:
            if not isinstance(element, tuple) or len(element) < 2:
                return None
            labels = _as_classes(element[1])
            if labels is None:
                return None
            parts.append(labels)
        return np.concatenate(parts) if parts else None
    return _as_classes(np.asarray(val_data[1])) if isinstance(val_data, (tuple, list)) else None


def predicted_labels(model: keras.Model, val_x: Any, batch_size: int,
                     expected: int) -> Optional[Tuple[int, ...]]:
    """Argmax predictions of a classifier with one (n, k >= 2) output, else None."""
    kwargs = {} if isinstance(val_x, tf.data.Dataset) else {"batch_size": batch_size}
    scores = model.predict(val_x, verbose=0, **kwargs)
    if not isinstance(scores, np.ndarray) or scores.ndim != 2 or scores.shape[1] < 2 or len(scores) != expected:
        return None
    return tuple(int(i) for i in np.argmax(scores, axis=1))


def _run_one(
    requested: str,
    policy: str,
    build_model: Callable[[], keras.Model],
    fit_kwargs: dict,
    samples_per_step: int,
    epochs: int,
    seed: int,
    val: Optional[Tuple[Any, int, int]],
) -> Tuple[RunResult, keras.Model]:
    """Builds, checks and trains one model under `policy` with `seed`; returns its numbers and the model.

    `val` is ``(validation inputs, batch size, number of labels)`` when predictions are wanted.
    """
    # policy_scope: the same float32 forcing and optimizer wrapping as tfmp.enable().
    with policy_scope(policy, verbose=False):
        keras.utils.set_random_seed(seed)
        model = build_model()
        if not isinstance(model, keras.Model) or not model.compiled:
            raise invalid_argument(
                "build_model", build_model,
                "a callable returning a compiled keras.Model",
                fix="Call model.compile(optimizer, loss, metrics=...) inside "
                    "build_model before returning the model.")
        checksum = float(sum(np.abs(np.asarray(w.numpy(), dtype="float64")).sum()
                             for w in model.trainable_weights))
        timer = StepTimer()
        start = time.perf_counter()
        history = model.fit(**fit_kwargs, epochs=epochs, verbose=0, callbacks=[timer])
        wall = time.perf_counter() - start
        predictions = None if val is None else predicted_labels(model, *val)
    # The first step traces and compiles the graph; leave it out of the timing.
    timed = timer.durations[1:] or timer.durations
    step = statistics.median(timed)
    result = RunResult(
        requested=requested,
        policy=policy,
        history={k: [float(v) for v in vs] for k, vs in history.history.items()},
        step_time_s=step,
        samples_per_second=samples_per_step / step,
        steps_timed=len(timed),
        wall_time_s=wall,
        initial_weights_checksum=checksum,
        seed=seed,
        predictions=predictions,
    )
    return result, model


_SEEDS_WHY = f"at most {MAX_SEEDS}: each seed trains every policy once"


def _seed_list(seed: int, seeds: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    """The seeds to run: `seed`, `seed` + 1, ... or an explicit sequence."""
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        if not 1 <= seeds <= MAX_SEEDS:
            raise invalid_argument("seeds", seeds, f"a positive int or a sequence of ints ({_SEEDS_WHY})",
                                   fix="Pass e.g. seeds=5 (seeds 0..4 from seed=0).")
        return tuple(range(seed, seed + seeds))
    if isinstance(seeds, (list, tuple)) and len(seeds) > MAX_SEEDS:
        raise invalid_argument("seeds", seeds, f"a sequence of distinct ints ({_SEEDS_WHY})",
                               fix=f"Pass {MAX_SEEDS} seeds or fewer, e.g. seeds=5.")
    values = tuple(seeds) if isinstance(seeds, (list, tuple)) else ()
    if not values or len(set(values)) != len(values) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise invalid_argument("seeds", seeds, "a positive int or a sequence of distinct ints",
                               fix="Pass e.g. seeds=5 or seeds=(0, 1, 2).")
    return values


def compare(
    build_model: Callable[[], keras.Model],
    train_data: Data,
    val_data: Optional[Data] = None,
    policies: Sequence[str] = (FLOAT32, "auto"),
    epochs: int = 3,
    seed: int = 0,
    batch_size: int = 32,
    tolerance: float = 0.5,
    seeds: Union[int, Sequence[int]] = 1,
    timing_rounds: int = 5,
) -> CompareReport:
    """Trains the same model under each policy and seed and judges the differences.

    Per seed, each policy is set, the seed reset (`keras.utils.set_random_seed`) and
    `build_model`'s model fit on the same data in the same order, so runs of one seed
    differ only in the arithmetic. Per metric, the differences to float32 at the same
    seed give a mean with a 95% Student t interval; float32's seed-to-seed spread is the
    noise floor. For a classifier with `val_data`, per-example agreement and McNemar's
    exact test are computed per seed. The first seed's models are then timed in turns.
    The global policy is restored; the global random generators keep the last seed.

    Args:
        build_model: Callable with no arguments returning a compiled `keras.Model`.
            It is called once per policy and seed, with that policy already set, so
            layers created inside it take it (give output layers ``dtype="float32"``).
        train_data: Tuple ``(x, y)`` of arrays (batched with `batch_size`) or a
            batched `tf.data.Dataset` yielding ``(x, y)``. A dataset brings its own
            order: shuffle it there with a fixed seed, or every policy sees another.
        val_data: Same forms as `train_data`, or None. Gives ``val_*`` metrics and,
            for classifiers, the per-example statistics.
        policies: Sequence of policy names (or `keras.DTypePolicy`); ``"auto"`` means
            `tfmp.recommend_policy().policy`. Must include ``"float32"`` (the
            reference) and one more.
        epochs: Int > 0. Epochs per run.
        seed: Int. First seed (weights, dropout and shuffling).
        batch_size: Int > 0. Used when `train_data` is a tuple of arrays.
        tolerance: Float >= 0. Default tolerance of `CompareReport.verdict`, in
            percentage points for accuracy-like metrics (0.5 means 0.5 pp).
        seeds: Int in [1, 1000] (seeds `seed` .. `seed` + seeds - 1) or a sequence
            of at most 1000 distinct ints. One seed gives no interval, so its verdict
            may judge noise; 5 give one (cost: seeds x policies trainings).
        timing_rounds: Int >= 1. Alternated timed calls per policy (10 steps or an
            epoch each, whichever is fewer); speed is the median of paired ratios.

    Returns:
        `CompareReport`: curves and final metrics per run, differences with intervals
        and noise floor (`statistics()`), agreement and McNemar (`agreement()`), speed
        and a verdict; ``print(report)`` shows a table, ``report.plot()`` the curves.

    Raises:
        ValueError: (template, before any training) `policies` not a list or tuple of
            at least two distinct policy names or `keras.DTypePolicy`, an unknown
            name, no float32 reference, or two that resolve to the same policy here
            ("auto" is float32 on a CPU without bfloat16); `epochs`, `batch_size` or
            `timing_rounds` not an int >= 1; `seed` not an int; bad `seeds`;
            `tolerance` not a finite number >= 0; `build_model` not callable;
            `train_data` or `val_data` neither a dataset that yields a batch nor
            ``(x, y)`` arrays of numbers with as many rows (>= 1) in x as in y. Also,
            before the first fit, `build_model` not returning a compiled model.
        ModuleNotFoundError: scipy (the ``compare`` extra) is not installed.

    Example:
        ``report = tfmp.compare(build, (x, y), (x_val, y_val), epochs=5, seeds=5)``
        then ``print(report)`` and ``report.verdict(tolerance=0.25)``.
    """
    defaults = inspect.signature(compare).parameters
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("timing_rounds", timing_rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid_argument(name, value, "a positive int",
                                   fix=f"Pass e.g. {name}={defaults[name].default} (the default).")
    if not callable(build_model) or isinstance(build_model, keras.Model):
        raise invalid_argument(
            "build_model", build_model, "a callable returning a compiled keras.Model",
            fix="Pass the function that builds and compiles the model (each policy "
            "needs a model of its own), e.g. compare(make_model, data), not make_model().",
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise invalid_argument("seed", seed, "an int", fix="Pass e.g. seed=0.")
    seed_list = _seed_list(seed, seeds)
    named = isinstance(policies, (list, tuple)) and all(
        isinstance(p, (str, keras.DTypePolicy)) for p in policies)
    distinct = named and len({getattr(p, "name", p) for p in policies}) == len(policies)
    if not distinct or len(policies) < 2:
        raise invalid_argument(
            "policies", policies, "a sequence of at least two distinct policy names",
            fix="Pass e.g. policies=('float32', 'auto').")
    real = isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool)
    if not (real and math.isfinite(tolerance) and tolerance >= 0):
        raise invalid_argument("tolerance", tolerance, "a finite float >= 0 (percentage points)",
                               fix="Pass e.g. tolerance=0.5 (the default: half a percentage point).")
    try:
        resolved = [(getattr(p, "name", p), resolve_policy(p).policy) for p in policies]
    except ValueError as error:
        raise invalid_argument("policies", policies, "names of policies tfmp knows",
                               fix=str(error)) from error
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
    labels, val = None, None
    if val_data is not None:
        val_kwargs, _ = _fit_arguments(val_data, "val_data", batch_size)
        fit_kwargs["validation_data"] = (val_kwargs["x"], val_kwargs["y"]) \
            if "y" in val_kwargs else val_kwargs["x"]
        labels = class_labels(val_data)
        if labels is not None:
            val = (val_kwargs["x"], batch_size, len(labels))
    compare_stats.scipy_stats()  # a missing scipy is said before any training
    runs, speed = [], {}
    for s in seed_list:
        models = {}
        for requested, policy in resolved:
            run, model = _run_one(requested, policy, build_model, fit_kwargs,
                                  samples_per_step, epochs, s, val)
            runs.append(run)
            if not speed:  # the first seed's models are timed below, then dropped
                models[run.label] = model
            del model
        if models:
            per_epoch = max(1, (runs[0].steps_timed + 1) // epochs)
            steps = min(TIMING_STEPS, per_epoch)
            # The float32 model first: it is the reference of the paired ratios.
            order = sorted(runs, key=lambda r: r.policy != FLOAT32)
            speed = time_alternately(
                {r.label: models[r.label] for r in order},
                timing_kwargs(fit_kwargs, samples_per_step, steps),
                timing_rounds)
        del models
        gc.collect()
    settings: Dict[str, Any] = dict(epochs=epochs, seeds=list(seed_list),
                                    samples_per_step=samples_per_step,
                                    device=recommend_policy().device)
    return CompareReport(runs=tuple(runs), tolerance=float(tolerance), settings=settings,
                         speed=speed,
                         val_labels=None if labels is None else tuple(int(i) for i in labels))
