"""The arguments of `tfmp.LossScaleOptimizer` and `tfmp.scaled_gradients`, checked at the public call
with the template error (`tfmp._src.errors`) naming the argument."""

from __future__ import annotations

import inspect
from typing import Any, Dict

import keras
import tensorflow as tf

from tfmp._src.errors import (
    check_bool,
    check_positive_int,
    check_positive_number,
    check_type,
    invalid_argument,
    unknown_fix,
)
from tfmp._src.loss_scale import guard as _guard

ON_STUCK = ("raise", "warn")
#: Keras's backwards-compatibility arguments (older Keras configs carry them), at their defaults.
KERAS_COMPAT_DEFAULTS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None,
    "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
    "loss_scale_factor": None, "gradient_accumulation_steps": None,
}
#: `tfmp.LossScaleOptimizer`'s default ``min_scale``.
DEFAULT_MIN_SCALE = 1.0
#: Defaults of the scales and counts, as messages show them.
_DEFAULTS = {"initial_scale": "2.0**15", "min_scale": "1.0", "max_scale": "2.0**24",
             "dynamic_growth_steps": "2000", "hysteresis": "1", "max_consecutive_overflows": "32"}
_ARGUMENTS = ("inner_optimizer", "initial_scale", "dynamic_growth_steps", "min_scale", "max_scale",
              "hysteresis", "max_consecutive_overflows", "on_stuck", "loss_scaling", "guard", "name")


def _bounds_fix(initial_scale: float, min_scale: float, max_scale: float, loss_scaling: Any) -> str:
    """A fix passing every bound check: ``max_scale`` kept, ``min_scale`` and ``initial_scale`` moved under it."""
    low = min(min_scale, max_scale)
    changed = [("min_scale", min_scale, low)]
    if loss_scaling:
        changed.append(("initial_scale", initial_scale, min(max(initial_scale, low), max_scale)))
    passed = [f"{name}={new!r}" for name, old, new in changed if new != old]
    return f"Pass e.g. {', '.join(passed)} with max_scale={max_scale!r}."


def check_arguments(inner_optimizer: Any, initial_scale: Any, dynamic_growth_steps: Any, **settings: Any) -> None:
    """Raises ValueError (template) as `check_settings`, or for an `inner_optimizer` that is not a Keras
    optimizer or is a loss-scale optimizer itself."""
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise invalid_argument(
            "inner_optimizer", inner_optimizer,
            "an optimizer that does not scale the loss itself (not a LossScaleOptimizer)",
            fix="Pass its inner optimizer: tfmp.LossScaleOptimizer(opt.inner_optimizer), or "
            "keep the one wrapper you have (loss scaling twice scales the loss twice).",
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise invalid_argument(
            "inner_optimizer", inner_optimizer, "a keras.optimizers.Optimizer instance",
            "Pass an optimizer instance, e.g. tfmp.LossScaleOptimizer(keras.optimizers.get('adam')).",
        )
    check_settings(initial_scale, dynamic_growth_steps, inner_optimizer=inner_optimizer, **settings)


def check_settings(
    initial_scale: Any, dynamic_growth_steps: Any, *, min_scale: Any, max_scale: Any, hysteresis: Any,
    max_consecutive_overflows: Any, on_stuck: Any, loss_scaling: Any, guard: Any, name: Any,
    kwargs: Dict[str, Any], inner_optimizer: Any = None,
) -> None:
    """Raises ValueError (template) for an argument of `tfmp.LossScaleOptimizer` it refuses, the inner
    optimizer aside (given only to name an unknown argument's owner); runs no TensorFlow op."""
    for arg, value in (("initial_scale", initial_scale), ("min_scale", min_scale), ("max_scale", max_scale)):
        check_positive_number(arg, value, fix=f"Pass e.g. {arg}={_DEFAULTS[arg]} (the default).")
    for arg, value in (("dynamic_growth_steps", dynamic_growth_steps), ("hysteresis", hysteresis),
                       ("max_consecutive_overflows", max_consecutive_overflows)):
        check_positive_int(arg, value, fix=f"Pass e.g. {arg}={_DEFAULTS[arg]} (the default).")
    if min_scale > max_scale:
        # Name the bound the user set: max_scale alone below the default min_scale blames max_scale.
        bound, value, expected = (
            ("max_scale", max_scale, f"a value >= min_scale={min_scale!r}")
            if min_scale == DEFAULT_MIN_SCALE else
            ("min_scale", min_scale, f"a value <= max_scale={max_scale!r}"))
        raise invalid_argument(bound, value, expected,
                               fix=_bounds_fix(initial_scale, min_scale, max_scale, loss_scaling))
    if loss_scaling and not min_scale <= initial_scale <= max_scale:
        raise invalid_argument(
            "initial_scale", initial_scale,
            f"a value in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]",
            fix=f"Pass e.g. initial_scale={min(max(initial_scale, min_scale), max_scale)!r}, "
            "or widen min_scale and max_scale.",
        )
    if not isinstance(on_stuck, str) or on_stuck not in ON_STUCK:
        raise invalid_argument("on_stuck", on_stuck, "one of 'raise', 'warn'", choices=ON_STUCK,
                               fix="Pass on_stuck='raise' (stop the run, the default) or on_stuck='warn'.")
    check_bool("loss_scaling", loss_scaling)
    _guard.check_guard(guard, loss_scaling)
    if name is not None and not (isinstance(name, str) and name and "/" not in name):
        raise invalid_argument("name", name, "None or a non-empty string without '/'",
                               fix="Pass e.g. name='loss_scale_optimizer'.")
    _check_keras_kwargs(kwargs, inner_optimizer)


def _unknown_argument_fix(key: str, inner: Any) -> str:
    """The fix for an unknown keyword: the inner optimizer's goes there; else a close spelling."""
    inner_class = type(inner) if isinstance(inner, keras.optimizers.Optimizer) else keras.optimizers.Adam
    if key != "name" and key in inspect.signature(inner_class.__init__).parameters:
        return (f"Unknown argument {key!r}: it is the inner optimizer's; set it there, e.g. "
                f"tfmp.LossScaleOptimizer(keras.optimizers.{inner_class.__name__}({key}=...)).")
    return unknown_fix(f"Unknown argument {key!r}.", key, _ARGUMENTS)


def _check_keras_kwargs(kwargs: Dict[str, Any], inner: Any) -> None:
    """Accepts only Keras's backwards-compatibility keyword arguments, at their defaults."""
    unknown = [key for key in kwargs if key != "dynamic" and key not in KERAS_COMPAT_DEFAULTS]
    if unknown:
        raise invalid_argument(
            unknown[0], kwargs[unknown[0]],
            "an argument of tfmp.LossScaleOptimizer: one of " + ", ".join(_ARGUMENTS),
            fix=" ".join(_unknown_argument_fix(key, inner) for key in unknown),
        )
    for key, value in kwargs.items():
        if key == "dynamic" and value is not True:
            raise invalid_argument(
                "dynamic", value, "True (Keras's old flag; the scale is always dynamic)",
                fix="For a fixed scale of 1.0 pass loss_scaling=False, or set `loss_scale_factor` on "
                "the `inner_optimizer` and use it without the wrapper.",
            )
        default = KERAS_COMPAT_DEFAULTS.get(key)
        if key != "dynamic" and value is not default and value != default:
            raise invalid_argument(
                key, value, f"{default!r} (the base optimizer's default) on the wrapper",
                fix=f"Set `{key}` on the `inner_optimizer` instead, e.g. keras.optimizers.SGD({key}=...).",
            )


def check_gradient_arguments(loss: Any, variables: Any, optimizer: Any) -> list:
    """Checks `tfmp.scaled_gradients`'s `loss`, `variables` and `optimizer` (its Raises); the variables as a list."""
    rank = loss.shape.rank if tf.is_tensor(loss) else None
    floating = (tf.is_tensor(loss) or isinstance(loss, (tf.Variable, keras.Variable))) and \
        tf.as_dtype(loss.dtype).is_floating
    if not floating or rank not in (0, None):
        raise invalid_argument(
            "loss", loss, "a scalar float tensor computed inside the tape",
            fix="Compute the loss inside `with tf.GradientTape() as tape:` and reduce it to a "
            "scalar, e.g. keras.ops.mean(per_example_loss).",
        )
    expected = "a non-empty list or tuple of variables, e.g. model.trainable_variables"
    check_type("variables", variables, (list, tuple), expected,
               items=(tf.Variable, keras.Variable, tf.Tensor),
               fix="Pass the variables themselves, e.g. model.trainable_variables, not their names or values.")
    if not variables:
        raise invalid_argument("variables", variables, expected,
                               fix="Build the model first (call it once) so that it has variables.")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise invalid_argument(
            "optimizer", optimizer, "a keras.optimizers.Optimizer instance (the one that applies them)",
            fix="Pass the optimizer object, e.g. model.optimizer, not its name.",
        )
    return list(variables)
