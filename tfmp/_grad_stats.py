"""Is loss scaling doing its job? Gradient statistics, every N steps, in the graph.

`GradientStats` wraps the optimizer's `apply` (the call that receives the
gradients of the scaled loss in `fit`) with a `tf.cond` that, every `every` steps,
reduces the gradients to four numbers kept in variables:

- ``grad_norm``: the global L2 norm of the gradients after unscaling
  (sqrt of the sum of squares of every element, divided by the loss scale).
- ``grad_underflow_fraction``: elements whose magnitude after scaling is below
  2**-24, the smallest float16 subnormal (IEEE 754 binary16), but not zero: in
  float16 they would flush to zero. Values computed in float16 have already
  flushed, so this counts what float32 computations (layers kept in float32,
  bfloat16 or float32 runs) hand over.
- ``grad_zero_fraction``: elements exactly zero; in a float16 run it includes the
  values that underflowed (compare with a float32 run of the same model).
- ``grad_overflow_fraction``: elements above 65504, the largest float16 value,
  after scaling, or non-finite: in float16 they are inf.

Fractions are over all elements of all gradients (the `values` of sparse ones).
Under a distribution strategy the statistics are those of the first replica's
gradients. On other steps the cost is one counter increment and a `tf.cond`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

#: IEEE 754 binary16 limits, from NumPy: 2**-24 and 65504.
FLOAT16_SMALLEST_SUBNORMAL = float(np.finfo(np.float16).smallest_subnormal)
FLOAT16_MAX = float(np.finfo(np.float16).max)
NAMES = (
    "grad_norm",
    "grad_underflow_fraction",
    "grad_overflow_fraction",
    "grad_zero_fraction",
)


def _variable(strategy: Any, value: Any, dtype: tf.DType) -> tf.Variable:
    """A replica-local variable: each replica writes its own copy, without the
    cross-replica synchronization an assignment inside `tf.cond` cannot do; reads
    outside replicas give the first replica's copy."""
    with strategy.scope():
        return tf.Variable(
            value,
            dtype=dtype,
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )


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


class GradientStats:
    """Computes gradient statistics every `every` steps of `optimizer.apply`.

    Args:
        optimizer: The model's optimizer. For a `keras.optimizers.
            LossScaleOptimizer` (tfmp's included) the gradients it receives are
            multiplied by `dynamic_scale`; otherwise by `loss_scale_factor` or 1.
        every: Int >= 1. Steps between two computations.
        strategy: `tf.distribute.Strategy` the model trains under.
    """

    def __init__(
        self, optimizer: keras.optimizers.Optimizer, every: int, strategy: Any
    ) -> None:
        self.optimizer = optimizer
        self.every = every
        self._counter = _variable(strategy, 0, tf.int64)
        self._step = _variable(strategy, -1, tf.int64)
        self._values = _variable(strategy, [0.0] * len(NAMES), tf.float32)
        self._original_apply = None

    def _scale(self) -> tf.Tensor:
        scale = getattr(self.optimizer, "dynamic_scale", None)
        if scale is None:
            scale = self.optimizer.loss_scale_factor or 1.0
        return tf.cast(tf.convert_to_tensor(scale), tf.float32)

    def _record(self, grads: list) -> None:
        step = self._counter.assign_add(1)

        def compute() -> tf.Tensor:
            self._values.assign(_statistics(list(grads), self._scale()))
            self._step.assign(step)
            return tf.constant(True)

        tf.cond(tf.equal(step % self.every, 0), compute, lambda: tf.constant(False))

    def install(self, start_step: int) -> None:
        """Wraps `optimizer.apply`; the next step is number `start_step + 1`.

        The train function must be traced again to see the wrapper (the monitor
        calls `model.make_train_function(force=True)`).
        """
        if self._original_apply is not None:
            return
        self._counter.assign(start_step)
        self._step.assign(-1)
        self._original_apply = original = self.optimizer.apply

        def apply(grads: list, trainable_variables: Optional[list] = None) -> Any:
            self._record(grads)
            return original(grads, trainable_variables)

        self.optimizer.apply = apply

    def uninstall(self) -> None:
        """Puts the optimizer's own `apply` back."""
        if self._original_apply is not None:
            del self.optimizer.apply
            self._original_apply = None

    def read(self) -> Optional[Tuple[int, Dict[str, float]]]:
        """(step, {name: value}) of the latest computation, or None if none yet."""
        step = int(self._step.numpy())
        if step < 0:
            return None
        return step, dict(zip(NAMES, (float(v) for v in self._values.numpy())))
