"""What `tfmp.LossScaleMonitor` reads: loss-scaling state, overflow history, samples.

All from variables training updates in the graph, so a read between two executions of the
train function sees every step in between, whatever `steps_per_execution`; the monitor
reads only at its logging points (cost: docs/guides/tensorboard.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional

import keras

from tfmp._src.keras_hooks.trainer import loss_tracker
from tfmp._src.loss_scale import guard as _guard
from tfmp._src.loss_scale.optimizer import LossScaleOptimizer


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """Loss-scaling state of an optimizer at one moment, as Python numbers.

    `step` counts steps trained, skipped ones included (`total_steps` of a
    `tfmp.LossScaleOptimizer`, else `iterations`); `overflow_count` and
    `consecutive_overflows` are 0 for optimizers that do not count them;
    `learning_rate` is the next step's, None if the optimizer has none.
    """

    step: int
    loss_scale: float
    overflow_count: int
    consecutive_overflows: int
    learning_rate: Optional[float]


@dataclasses.dataclass(frozen=True)
class OverflowEvent:
    """One skipped step from the overflow history: its one-based number (the monitor's step
    axis) and the loss scale it ran with and the one after it."""

    step: int
    scale_before: float
    scale_after: float


def _numpy(value: Any) -> Any:
    """Value of a variable, tensor or Python number, without a copy warning."""
    return value.numpy() if hasattr(value, "numpy") else value


def read_state(optimizer: Any) -> LossScaleState:
    """The `LossScaleState` of `optimizer`, its starting values when not built.

    `tfmp.LossScaleOptimizer` gives every field, a Keras `LossScaleOptimizer` its scale,
    other optimizers a scale of 1.0.
    """
    scale, overflows, consecutive = 1.0, 0, 0
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scale = float(optimizer.dynamic_scale.numpy() if optimizer.built else optimizer.initial_scale)
    if isinstance(optimizer, LossScaleOptimizer) and optimizer.built:
        step = int(optimizer.total_steps.numpy())
        overflows = int(optimizer.overflow_count.numpy())
        consecutive = int(optimizer.consecutive_overflows.numpy())
    else:
        step = int(optimizer.iterations.numpy())
    rate = getattr(optimizer, "learning_rate", None)
    lr = None if rate is None else float(_numpy(rate))
    return LossScaleState(step, scale, overflows, consecutive, lr)


def read_overflow_events(optimizer: Any, first: int, stop: int) -> tuple[List[OverflowEvent], int]:
    """(events in step order, count too old to itemize) of skipped steps number `first` to `stop - 1`.

    The k-th skipped step sits in slot ``k % OVERFLOW_HISTORY`` of a built
    `tfmp.LossScaleOptimizer`'s ring buffers (other optimizers give nothing).
    """
    history = getattr(optimizer, "overflow_history_steps", None)
    if history is None or stop <= first:
        return [], 0
    steps = history.numpy()
    scales = optimizer.overflow_history_scales.numpy()
    size = len(steps)
    start = max(first, stop - size)
    events = []
    for k in range(start, stop):
        before, after = (float(v) for v in scales[k % size])
        events.append(OverflowEvent(int(steps[k % size]) + 1, before, after))
    return events, start - first


def format_scale(value: float) -> str:
    """Formats a loss scale exactly: powers of two >= 1 as integers (``32768``)."""
    if math.isfinite(value) and value.is_integer():
        return str(int(value))
    return repr(value)


def skip_cause(optimizer: Any) -> str:
    """What made `optimizer` skip a step: ``"non-finite gradients"`` when its guard checks every
    gradient, else ``"non-finite loss or gradients"`` (the loss guard)."""
    checks = _guard.resolve(optimizer.guard, optimizer.loss_scaling)
    return "non-finite gradients" if checks == "gradients" else "non-finite loss or gradients"


def describe(event: OverflowEvent, cause: str = "non-finite gradients") -> str:
    """The skipped step's text summary; `cause` as from `skip_cause`.

    Example:
        >>> describe(OverflowEvent(117, 32768.0, 16384.0))
        'step 117: non-finite gradients, scale 32768 -> 16384'
    """
    return (
        f"step {event.step}: {cause}, scale "
        f"{format_scale(event.scale_before)} -> {format_scale(event.scale_after)}"
    )


def samples_this_epoch(model: Any) -> Optional[int]:
    """Samples `model` trained on since `fit` last reset its metrics, or None without a loss tracker.

    Keras's `train_step` updates the loss tracker (a `keras.metrics.Mean`) with the
    batch size as sample weight, so its `count` is the samples seen. Under a strategy
    the variable is sync-on-read: reading it whole is a collective only the chief would
    join, so this worker's replicas are summed and scaled to the cluster (exact for
    `MirroredStrategy` and equal shards per worker).
    """
    tracker = loss_tracker(model)
    count = getattr(tracker, "count", None)
    if count is None:
        return None
    local_parts = getattr(getattr(count, "value", count), "values", None)
    if local_parts is None:
        return int(_numpy(count))
    local = sum(int(part.numpy()) for part in local_parts)
    return local * model.distribute_strategy.num_replicas_in_sync // len(local_parts)
