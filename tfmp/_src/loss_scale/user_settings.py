"""Loss-scaling settings a user gave that tfmp changes or does not use: said once (`tfmp.LossScaleWarning`).

A Keras `LossScaleOptimizer` given to ``compile()`` becomes a `tfmp.LossScaleOptimizer`
keeping its settings; scaling settings for a bfloat16 or float32 model are unused.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Mapping

import keras

from tfmp._src.errors import warn
from tfmp._src.loss_scale.guard import LossScaleWarning

#: Options of `tfmp.LossScaleOptimizer` that do nothing with ``loss_scaling=False``.
SCALING_SETTINGS = ("initial_scale", "dynamic_growth_steps", "min_scale", "max_scale", "hysteresis")
#: The settings of a Keras `LossScaleOptimizer` that tfmp's wrapper takes over.
KERAS_SETTINGS = ("initial_scale", "dynamic_growth_steps")

_warned_keras_optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _listed(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in settings.items())


def _no_scaling_reason(compute_dtype: str) -> str:
    if compute_dtype == "bfloat16":
        return "A bfloat16 model needs no loss scaling (float32's range)"
    return f"A {compute_dtype} model needs no loss scaling"


def keras_settings(optimizer: keras.optimizers.LossScaleOptimizer) -> Dict[str, Any]:
    """Dict. The `KERAS_SETTINGS` of a Keras `LossScaleOptimizer`, as Python numbers."""
    return {"initial_scale": float(optimizer.initial_scale),
            "dynamic_growth_steps": int(optimizer.dynamic_growth_steps)}


def take_keras_settings(optimizer: keras.optimizers.LossScaleOptimizer, options: Mapping[str, Any],
                        default_bounds: Mapping[str, float]) -> Dict[str, Any]:
    """Dict: the options of the `tfmp.LossScaleOptimizer` replacing `optimizer`: `options`, then its
    `KERAS_SETTINGS`; an ``initial_scale`` outside `default_bounds` moves the bound it passes."""
    chosen = {**keras_settings(optimizer), **options}
    initial = chosen["initial_scale"]
    if "max_scale" not in chosen and initial > default_bounds["max_scale"]:
        chosen["max_scale"] = initial
    if "min_scale" not in chosen and initial < default_bounds["min_scale"]:
        chosen["min_scale"] = initial
    return chosen


def warn_keras_optimizer_replaced(optimizer: keras.optimizers.LossScaleOptimizer, options: Mapping[str, Any],
                                  compute_dtype: str) -> None:
    """Warns (`LossScaleWarning`) once per Keras `optimizer` that tfmp's, built with `options`, takes its place."""
    if optimizer in _warned_keras_optimizers:
        return
    _warned_keras_optimizers.add(optimizer)
    given = keras_settings(optimizer)
    inner = type(optimizer.inner_optimizer).__name__
    if options["loss_scaling"]:
        overridden = {key: options[key] for key in KERAS_SETTINGS if options[key] != given[key]}
        kept = f"these but {_listed(overridden)} (from tfmp.enable)" if overridden else "these settings"
        cause = f"tfmp.LossScaleOptimizer keeps {kept} and adds overflow counters and stuck detection."
    else:
        cause = f"{_no_scaling_reason(compute_dtype)}: the scale is fixed at 1.0 and these settings are unused."
    warn(f"tfmp replaced the Keras LossScaleOptimizer({inner}, {_listed(given)}) given to compile().",
         cause,
         f"Fix: pass the {inner} alone to silence this; compile after tfmp.disable() to keep Keras's optimizer.",
         LossScaleWarning, section="loss-scaling-in-a-custom-train_step")


def warn_unused_scaling_options(options: Mapping[str, Any], policy: str, compute_dtype: str) -> None:
    """Warns (`LossScaleWarning`) when `loss_scale_options` set `SCALING_SETTINGS` without ``loss_scaling``
    while `compute_dtype` is not float16, where a fixed scale ignores them."""
    given = {key: options[key] for key in SCALING_SETTINGS if key in options}
    if compute_dtype == "float16" or "loss_scaling" in options or not given:
        return
    warn(f"tfmp.enable(loss_scale_options=...) sets {_listed(given)}, which policy {policy!r} does not use.",
         f"{_no_scaling_reason(compute_dtype)}: "
         "tfmp fixes the scale at 1.0 and still skips non-finite steps.",
         "Fix: add 'loss_scaling': True to scale anyway, or 'loss_scaling': False to keep 1.0 silently.",
         LossScaleWarning, section="loss-scaling-in-a-custom-train_step")
