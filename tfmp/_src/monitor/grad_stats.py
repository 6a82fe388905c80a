"""Is loss scaling doing its job? Gradient statistics, every N steps, in the graph.

`GradientStats` hooks the optimizer's `apply` with a `tf.cond` that, every N steps, reduces
the gradients (the first replica's under a strategy) to variables: the unscaled global norm,
the fractions float16 would flush (nonzero below 2**-24), overflow (above 65504 or
non-finite) or hold as zero, and the update-to-weight ratio, read against bfloat16's 2**-8.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfmp._src.constants import BFLOAT16_EPSILON, FLOAT16_MAX, FLOAT16_SMALLEST_SUBNORMAL
from tfmp._src.distribute import replica_local_variable
from tfmp._src.keras_hooks import optimizer_steps
from tfmp._src.keras_hooks.object_state import PerObject
from tfmp._src.keras_hooks.runtime_options import in_xla_context

NAMES = ("grad_norm", "grad_underflow_fraction", "grad_overflow_fraction", "grad_zero_fraction", "update_ratio")
#: Reference line written with ``update_ratio``: `BFLOAT16_EPSILON` (2**-8).
PRECISION_TAG = "bfloat16_relative_precision"


def _statistics(grads: list, scale: tf.Tensor) -> tf.Tensor:
    """[norm, underflow, overflow, zero] of gradients multiplied by `scale`."""
    squares = elements = under = over = zero = tf.constant(0.0, tf.float32)
    for grad in grads:
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            grad = grad.values
        magnitude = tf.abs(tf.cast(grad, tf.float32))
        squares += tf.reduce_sum(tf.square(magnitude / scale))
        elements += tf.cast(tf.size(magnitude), tf.float32)
        tiny = tf.logical_and(magnitude > 0.0, magnitude < FLOAT16_SMALLEST_SUBNORMAL)
        under += tf.reduce_sum(tf.cast(tiny, tf.float32))
        over += tf.reduce_sum(tf.cast(~(magnitude <= FLOAT16_MAX), tf.float32))
        zero += tf.reduce_sum(tf.cast(tf.equal(magnitude, 0.0), tf.float32))
    count = tf.maximum(elements, 1.0)
    return tf.stack([tf.sqrt(squares), under / count, over / count, zero / count])


def _update_ratio(variables: list, before: list) -> tf.Tensor:
    """||variables - before|| / ||before||, global L2 norms, float32 scalar."""
    update = weight = tf.constant(0.0, tf.float32)
    for variable, old in zip(variables, before):
        old = tf.cast(old, tf.float32)
        update += tf.reduce_sum(tf.square(tf.cast(variable.value, tf.float32) - old))
        weight += tf.reduce_sum(tf.square(old))
    moved = tf.where(update > 0.0, float("inf"), 0.0)
    return tf.where(weight > 0.0, tf.sqrt(update) / tf.sqrt(tf.maximum(weight, 1e-30)), moved)


class GradientStats:
    """Computes gradient statistics every `every` steps of `optimizer.apply`.

    One instance per optimizer (`of`), whose hook on `apply` is installed once and traced
    into the train function; `pause` and `resume` switch it with a variable, so later `fit`
    calls reuse the traced step; `remove` takes it off. The gradients `apply` receives are
    taken as multiplied by `dynamic_scale`, else `loss_scale_factor` or 1.
    """

    _registry = PerObject("gradient_stats")  # on the optimizer: its hook refers to it

    def __init__(self, optimizer: keras.optimizers.Optimizer, every: int, strategy: Any) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._counter = replica_local_variable(0, dtype=tf.int64, strategy=strategy)
        self._step = replica_local_variable(-1, dtype=tf.int64, strategy=strategy)
        self._every = replica_local_variable(every, dtype=tf.int64, strategy=strategy)
        self._on = replica_local_variable(False, dtype=tf.bool, strategy=strategy)
        self._values = replica_local_variable([0.0] * (len(NAMES) - 1), dtype=tf.float32, strategy=strategy)
        self._ratio = replica_local_variable(0.0, dtype=tf.float32, strategy=strategy)
        self._hook: Optional[optimizer_steps.Hook] = None

    @classmethod
    def of(cls, optimizer: keras.optimizers.Optimizer, every: int, strategy: Any) -> "GradientStats":
        """The statistics of `optimizer` (created at the first call), computed every `every` steps."""
        stats = cls._registry.get(optimizer)
        if stats is None:
            stats = cls._registry[optimizer] = cls(optimizer, every, strategy)
        stats._every.assign(np.int64(every))
        return stats

    def _scale(self) -> tf.Tensor:
        optimizer = self._optimizer()
        scale = getattr(optimizer, "dynamic_scale", None)
        if scale is None:
            scale = optimizer.loss_scale_factor or 1.0
        return tf.cast(tf.convert_to_tensor(scale), tf.float32)

    def _record(self, grads: list) -> tf.Tensor:
        """Computes the gradient statistics if due; returns whether they were (bool)."""
        step = self._counter.assign_add(1)

        def compute() -> tf.Tensor:
            self._values.assign(_statistics(list(grads), self._scale()))
            self._step.assign(step)
            return tf.constant(True)

        due = tf.logical_and(self._on, tf.equal(step % self._every, 0))
        tf.cond(due, compute, lambda: tf.constant(False))
        return due

    def _apply_recording_update(self, apply: Callable, grads: list, variables: Optional[list], due: tf.Tensor) -> Any:
        """Runs `apply`; if due, records the update ratio of `variables` (NaN if None)."""
        if not variables:
            self._ratio.assign(np.float32("nan"))
            return apply(grads, variables)
        if in_xla_context():
            # XLA compiles a tf.cond only when both branches give the same shapes: copy every step.
            before = [tf.identity(v.value) for v in variables]
        else:
            # Copies only when due: the update writes new buffers while these are alive.
            before = tf.cond(due, lambda: [tf.identity(v.value) for v in variables],
                             lambda: [tf.zeros([0], v.dtype) for v in variables])
        result = apply(grads, variables)

        def ratio() -> tf.Tensor:
            self._ratio.assign(_update_ratio(variables, before))
            return tf.constant(True)

        tf.cond(due, ratio, lambda: tf.constant(False))
        return result

    def resume(self, start_step: int) -> bool:
        """Switches the statistics on; the next step is number `start_step + 1`.

        Returns True when the hook was installed now: the train function must be traced again.
        """
        # A NumPy scalar: TensorFlow caches every Python int it converts, for good.
        self._counter.assign(np.int64(start_step))
        self._step.assign(-1)
        self._on.assign(True)
        if self._hook is not None:
            return False

        def wrap(apply: Callable) -> Callable:
            @functools.wraps(apply)
            def apply_with_statistics(grads: list, trainable_variables: Optional[list] = None) -> Any:
                due = self._record(grads)
                variables = None if trainable_variables is None else list(trainable_variables)
                return self._apply_recording_update(apply, grads, variables, due)

            return apply_with_statistics

        self._hook = optimizer_steps.subscribe(self._optimizer(), "apply", wrap, owner="grad_stats")
        return True

    def pause(self) -> None:
        """Stops computing (one variable write); the traced step keeps the hook."""
        self._on.assign(False)

    def remove(self) -> None:
        """Takes the hook off `apply`; other hooks on it stay."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._on.assign(False)

    def read(self) -> Optional[Tuple[int, Dict[str, float]]]:
        """(step, {name: value}) of the latest computation, or None if none yet."""
        step = int(self._step.numpy())
        if step < 0:
            return None
        numbers = [float(v) for v in self._values.numpy()] + [float(self._ratio.numpy())]
        values = dict(zip(NAMES, numbers))
        if np.isnan(values["update_ratio"]):  # apply was given no variables
            del values["update_ratio"]
        else:
            values[PRECISION_TAG] = BFLOAT16_EPSILON
        return step, values
