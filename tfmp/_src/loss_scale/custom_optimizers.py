"""Optimizers a custom ``compile`` keeps on the model (the keras.io DCGAN's ``self.d_optimizer``).

`adopt` wraps each optimizer held in an attribute, then or later, in `wrap_optimizer`'s
`tfmp.LossScaleOptimizer` (not ``model.optimizer``, nor optimizers in containers: warned).
Such a ``train_step`` seldom scales its loss: an ``apply`` in a step without its
``scale_loss`` takes the gradients as given, still checked, and warns once.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict

import keras

from tfmp._src.attachment import record
from tfmp._src.errors import warn
from tfmp._src.keras_hooks import optimizer_steps, train_function, trainer
from tfmp._src.keras_hooks.object_state import PerObject
from tfmp._src.keras_hooks.trainer import SETATTR_HOOK
from tfmp._src.loss_scale import loops
from tfmp._src.loss_scale.guard import LossScaleWarning, ScaleLossCalls
from tfmp._src.loss_scale.optimizer import LossScaleOptimizer, wrap_optimizer

#: The owner of the model's and the optimizers' hooks.
OWNER = "custom_optimizers"
#: The attribute Keras's own ``compile`` sets; the compile handler wraps it.
KERAS_ATTRIBUTE = "optimizer"
_ADOPTED = PerObject("custom_optimizer")  # wrapper -> name of the attribute it was stored under
_STORED = PerObject("custom_optimizers")  # model -> WeakSet of the wrappers stored on it
_STUCK = "stuck.custom_optimizers"  # the model's check after each train step


def _plain(value: Any) -> bool:
    return isinstance(value, keras.optimizers.Optimizer) and not isinstance(value, LossScaleOptimizer)


def adopt(model: keras.Model, compute_dtype: str, options: Dict[str, Any] | None) -> None:
    """Wraps the optimizers `model` holds in attributes now and later (after tfmp's ``compile``).

    `options` are `wrap_optimizer`'s (None: the optimizers stay as they are); the attributes
    wrapped are listed in `tfmp.Attachment.custom_optimizers`. Raises what `wrap_optimizer` raises.
    """
    trainer.SURFACE.unsubscribe(model, SETATTR_HOOK, OWNER)
    if options is None:
        return
    wrap = _wrap_setattr_hook(model, compute_dtype, dict(options))
    trainer.subscribe(model, SETATTR_HOOK, wrap, owner=OWNER)
    for name, value in list(vars(model).items()):
        if name == KERAS_ATTRIBUTE:
            continue
        if _plain(value):
            setattr(model, name, value)  # through the hook, which wraps it
        elif isinstance(value, LossScaleOptimizer) and _ADOPTED.get(value) is not None:
            _record(model, name)  # wrapped at an earlier compile: on the new attachment too


def _record(model: keras.Model, name: str) -> None:
    found = record.of(model)
    if found is not None and name not in found.custom_optimizers:
        found.custom_optimizers.append(name)


def _wrap_setattr_hook(model: keras.Model, compute_dtype: str, options: Dict[str, Any]) -> Callable:
    model_ref = weakref.ref(model)
    wrappers: "weakref.WeakKeyDictionary[Any, LossScaleOptimizer]" = weakref.WeakKeyDictionary()

    def wrap(setattr_hook: Callable) -> Callable:
        @functools.wraps(setattr_hook)
        def wrapping_setattr_hook(name: Any, value: Any) -> Any:
            name, value = setattr_hook(name, value)
            owner = model_ref()
            if owner is None or name == KERAS_ATTRIBUTE:
                return name, value
            if _plain(value):
                known = wrappers.get(value)
                value = known if known is not None else _wrapped(owner, name, value, compute_dtype, options)
                wrappers[value.inner_optimizer] = value
                _record(owner, name)
            elif isinstance(value, (list, tuple, dict)) and any(
                    map(_plain, value.values() if isinstance(value, dict) else value)):
                _warn_container(owner, name, compute_dtype)
            return name, value

        return wrapping_setattr_hook

    return wrap


def _wrapped(model: keras.Model, name: str, optimizer: Any, compute_dtype: str,
             options: Dict[str, Any]) -> LossScaleOptimizer:
    """The `tfmp.LossScaleOptimizer` to store under `name` for a plain `optimizer`."""
    keras_wrapped = vars(model).get(KERAS_ATTRIBUTE)
    if isinstance(keras_wrapped, LossScaleOptimizer) and keras_wrapped.inner_optimizer is optimizer:
        return keras_wrapped  # also passed as compile's `optimizer=`: one wrapper, one scale
    wrapped = wrap_optimizer(optimizer, compute_dtype, **options)
    loops.serve_optimizer(wrapped)  # checked after each step below
    _ADOPTED[wrapped] = name
    _STORED.setdefault(model, weakref.WeakSet()).add(wrapped)
    if not train_function.has_check(model, _STUCK):  # `loops` checks ``model.optimizer`` only
        train_function.add_check(model, _STUCK, functools.partial(_raise_if_stuck, weakref.ref(model)))
    if wrapped.loss_scaling:
        _apply_unscaled_gradients_as_given(wrapped, model.name, name)
    return wrapped


def forget(model: keras.Model) -> None:
    """Takes the setattr hook, the stuck check and the record of wrappers off `model` (`tfmp.detach`)."""
    trainer.SURFACE.unsubscribe(model, SETATTR_HOOK, OWNER)
    train_function.remove_check(model, _STUCK)
    _STORED.pop(model, None)


def _raise_if_stuck(model_ref: Callable, logs: Any) -> Any:
    model = model_ref()
    for optimizer in list(_STORED.get(model, ())) if model is not None else ():
        optimizer.raise_if_stuck()  # a no-op before `build`
    return logs


def _warn_container(model: keras.Model, name: str, compute_dtype: str) -> None:
    if compute_dtype == "float16":
        fix = "or wrap each in tfmp.LossScaleOptimizer and use tfmp.scaled_gradients"
    else:
        fix = "or wrap each in tfmp.LossScaleOptimizer(opt, loss_scaling=False)"
    warn(f"Model {model.name!r} keeps plain optimizers in `{name}` (a list, tuple or dict): tfmp cannot wrap them.",
         f"Under {compute_dtype} they apply gradients without loss scaling, step checks or counters.",
         f"Fix: keep each in an attribute of its own, {fix}.",
         LossScaleWarning, section="loss-scaling-in-a-custom-train_step")


def _apply_unscaled_gradients_as_given(optimizer: LossScaleOptimizer, model_name: str, name: str) -> None:
    """Hooks `optimizer`'s ``scale_loss`` and ``apply`` (the module docstring)."""
    steps = ScaleLossCalls()
    warned = []  # one LossScaleWarning per optimizer

    def wrap_scale_loss(scale_loss: Callable) -> Callable:
        @functools.wraps(scale_loss)
        def noting_scale_loss(loss: Any) -> Any:
            steps.note()
            return scale_loss(loss)

        return noting_scale_loss

    def wrap_apply(apply: Callable) -> Callable:
        @functools.wraps(apply)
        def apply_unscaled_as_given(grads: Any, trainable_variables: Any = None) -> Any:
            grads = list(grads)
            if not steps.take():
                if not warned:
                    warned.append(True)
                    _warn_unscaled(optimizer, model_name, name)
                optimizer._origins.note([], grads)  # as get_unscaled_gradients' tensors: not divided
            return apply(grads, trainable_variables)

        return apply_unscaled_as_given

    optimizer_steps.subscribe(optimizer, "scale_loss", wrap_scale_loss, owner=OWNER)
    optimizer_steps.subscribe(optimizer, "apply", wrap_apply, owner=OWNER)


def _warn_unscaled(optimizer: LossScaleOptimizer, model_name: str, name: str) -> None:
    warn(f"`{name}` of model {model_name!r} applies gradients of a loss that was not scaled.",
         "float16 gradients below ~6e-8 flush to zero; tfmp applies them as given, skipping inf/NaN steps.",
         f"Fix: in train_step, grads = tfmp.scaled_gradients(tape, loss, variables, self.{name}).",
         LossScaleWarning, section="loss-scaling-in-a-custom-train_step")
