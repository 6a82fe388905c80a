"""What `tfmp.compare` measures on a trained model: step times and predicted labels.

The trained models are timed in rotating turns so that a busy moment of a shared
machine falls on every policy alike; a policy's speed is the median of paired ratios,
as benchmarks/harness.py does.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

TIMING_STEPS = 10  # steps per timed call (fewer when an epoch has fewer)


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
