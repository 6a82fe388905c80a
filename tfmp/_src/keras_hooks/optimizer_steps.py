"""The optimizer surface: ``Optimizer.apply``, ``scale_loss`` and an inner optimizer's ``update_step``.

Subscribers innermost first in `SURFACE`. `LossScaleOptimizerBase` is the one subclass of Keras's
`LossScaleOptimizer` that names its private step handlers.

| private name used | where in Keras | what tfmp does with it |
|---|---|---|
| ``Optimizer._trainable_variables`` | ``keras/src/optimizers/base_optimizer.py`` | `optimizer_variables`: variables ``apply`` defaults to |
| ``Optimizer._overwrite_variable_with_gradient`` | same | `overwrites_with_gradient`: variables whose "gradient" is a new value, never unscaled |
| ``Optimizer._get_variable_index``, ``Adam._momentums`` / ``_velocities`` | ``keras/src/optimizers/base_optimizer.py``, ``keras/src/optimizers/adam.py`` | `adam_slots`, `sgd_momentum_slot`: a variable's slots, updated by `tfmp._src.policy.fused_update` |
| ``LossScaleOptimizer._stateful_handle_finite_grads`` / ``_stateful_handle_non_finite_grads`` | ``keras/src/optimizers/loss_scale_optimizer.py`` | overridden by `LossScaleOptimizerBase` only |
| ``keras.src.utils.tracking.no_automatic_dependency_tracking`` | ``keras/src/utils/tracking.py`` | `no_automatic_dependency_tracking`: tfmp's optimizer variables stored as attributes |
| ``tf.__internal__.distribute.interim.maybe_merge_call`` | TensorFlow's ``distribute/merge_call_interim.py`` (Keras's TensorFlow optimizer calls it) | `update_each`: writes to (possibly mirrored) variables from a step, as Keras's updates are made |
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import keras

from tfmp._src.keras_hooks import patches

SURFACE = patches.Surface(
    "optimizer steps",
    methods=("apply", "scale_loss", "update_step"),
    subscribers=("custom_optimizers", "numerics", "grad_stats", "fused_update"),
)
subscribe = SURFACE.subscribe

#: (class, attribute) pairs that must exist on the installed Keras's classes.
REQUIRED_ATTRIBUTES = (
    (keras.optimizers.Optimizer, "_overwrite_variable_with_gradient"),
    (keras.optimizers.Optimizer, "_get_variable_index"),
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_finite_grads"),
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_non_finite_grads"),
)

#: (class whose method is hooked or overridden, method, the parameters tfmp relies on, in order).
SIGNATURES: Tuple[Tuple[type, str, Tuple[str, ...]], ...] = (
    # numerics, grad_stats, optimizer: `apply(grads, trainable_variables=None)`, `scale_loss(loss)`.
    (keras.optimizers.Optimizer, "apply", ("grads", "trainable_variables")),
    (keras.optimizers.LossScaleOptimizer, "scale_loss", ("loss",)),
    # LossScaleOptimizerBase overrides Keras's stateful branches.
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_finite_grads", ("grads", "trainable_variables")),
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_non_finite_grads", ()),
)

#: (what tfmp relies on Keras doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = (
    ("LossScaleOptimizer.apply runs _stateful_handle_finite_grads or _stateful_handle_non_finite_grads",
     "tests/test_loss_scale.py::test_backoff_sequence_from_400"),
)


def optimizer_variables(optimizer: Any) -> list:
    """The trainable variables `optimizer.apply` uses when it is given none."""
    return list(optimizer._trainable_variables)


def overwrites_with_gradient(optimizer: Any, variable: Any) -> bool:
    """Bool. `optimizer` assigns the "gradient" of `variable` as its value (float8 scales): never unscale it."""
    return bool(optimizer._overwrite_variable_with_gradient(variable))


def adam_slots(optimizer: Any, variable: Any) -> tuple:
    """(first moment, second moment): the `keras.Variable` slots a built Adam keeps for `variable`."""
    index = optimizer._get_variable_index(variable)
    return optimizer._momentums[index], optimizer._velocities[index]


def sgd_momentum_slot(optimizer: Any, variable: Any) -> Any:
    """The `keras.Variable` momentum slot a built SGD (``momentum > 0``) keeps for `variable`."""
    return optimizer.momentums[optimizer._get_variable_index(variable)]


def update_each(update: Callable, pairs: list) -> None:
    """Runs ``update(target, source)`` for each ``(target, source)`` pair of variables, on each device.

    As Keras's TensorFlow optimizer updates a variable: in a cross-replica context through
    ``strategy.extended.update`` (per device: a mirrored `source` gives its copy on that
    device), also from a replica context and inside a `tf.cond` branch (TensorFlow's
    ``maybe_merge_call``); without a strategy, the default one.
    """
    import tensorflow as tf

    def update_all(strategy: Any, pairs: list) -> None:
        for target, source in pairs:
            strategy.extended.update(_tf_variable(target), update, args=(_tf_variable(source),), group=False)

    if tf.distribute.in_cross_replica_context():
        update_all(tf.distribute.get_strategy(), pairs)
    else:
        tf.__internal__.distribute.interim.maybe_merge_call(update_all, tf.distribute.get_strategy(), pairs)


def _tf_variable(variable: Any) -> Any:
    """The `tf.Variable` a `keras.Variable` holds (itself if it is one)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def no_automatic_dependency_tracking(function: Callable) -> Callable:
    """Keras's decorator: attributes set inside `function` are not tracked twice."""
    from keras.src.utils.tracking import no_automatic_dependency_tracking as decorator

    return decorator(function)


class LossScaleOptimizerBase(keras.optimizers.LossScaleOptimizer):
    """Keras's `LossScaleOptimizer` with its private step handlers renamed `_finite_step`, `_non_finite_step`."""

    def _stateful_handle_finite_grads(self, grads: list, trainable_variables: Optional[list]) -> None:
        self._finite_step(grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self) -> None:
        self._non_finite_step()

    def _finite_step(self, grads: list, trainable_variables: Optional[list]) -> None:
        super()._stateful_handle_finite_grads(grads, trainable_variables)

    def _non_finite_step(self) -> None:
        super()._stateful_handle_non_finite_grads()
