"""Method hooks: installed, composed and removed in one place.

Every method tfmp replaces on a Keras class or object (``compile``,
``compile_from_config``, ``make_train_function`` (and ``make_test_function``,
``make_predict_function`` of a model), ``train_step``, ``Layer.call``,
``Layer.compute_output_spec``, ``Layer.build``,
``BatchNormalization.call``, the backend's ``gelu`` and ``add``, ``Optimizer.apply``, ``Adam.update_step``,
``Optimizer.scale_loss``, ``tf.GradientTape.gradient``, the ``Layer.losses`` property, the
``Operation.from_config`` classmethod) goes through `install`. Per method of an object there is one *slot* holding the method as it was
and a stack of hooks; the attribute is the composition of the stack, innermost
first in the order of `ORDER`. Removing a hook rebuilds the composition from the
hooks that remain, so removing one never removes another, and removing the last
one restores exactly what was there (an instance attribute comes off; a class
attribute is put back).

A hook is a factory ``wrap(next_call) -> call``: it receives the callable below it
(for a class target an unbound function taking ``self``, for an instance a bound
callable) and returns the replacement. Hooks on an instance sit above hooks on its
class: the innermost callable of an instance slot looks the class attribute up at
each call.

Transactions. A slot's attribute is written twice at most: when its first hook
comes, with a *pass-through* that calls the slot's current composition, and when
its last hook goes, with what was there before. In between, installing or
removing a hook builds the new composition first and only then swaps it in, so a
``wrap`` that raises leaves the method and the slot as they were. A patch another
library puts on top of tfmp's (``other(tfmp(original))``) keeps working: tfmp never
writes over an attribute it did not write; when its last hook goes and another
patch sits on top, it leaves its pass-through (now calling the original) under that
patch and warns, naming it. `install_all` installs several hooks or none.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from tfmp._src.errors import user_stacklevel
from tfmp._src.keras_hooks.object_state import PerObject

#: Position of each hook owner in a stack, innermost first. A method with several
#: hooks always composes them in this order, whatever order they were installed in.
ORDER = {
    "fused_batchnorm": 5,  # BatchNormalization.call: the fused kernel for attached layers
    "gelu": 6,  # Keras's TensorFlow backend gelu: 16-bit exact GELU in float32 inside for attached models
    "conv": 6,  # Keras's TensorFlow backend conv / conv_transpose: float16 convolutions in float32 inside
    "bias_gradient": 7,  # Keras's TensorFlow backend add: 16-bit bias gradients summed in float32 for attached models
    "float32.build": 10,  # Layer.build: force sublayers created at build time
    "float32.exact": 11,  # Discretization / CategoryEncoding / Normalization.__init__ while enabled: float32
    "float32.from_config": 12,  # Operation.from_config (classmethod) while enabled: a float32 layer's sublayers
    "float32.outputs": 20,  # Model.call, an output block's call / compute_output_spec: outputs to float32
    "float32.cast_back": 25,  # Layer.call / compute_output_spec: forced layer hands back its parent's dtype
    "float32.ids": 26,  # DTypePolicy.convert_input / Layer.call / Embedding.call: exact float token ids
    "enable.dtype_errors": 28,  # Model.build / call: dtype mismatches explained (models tfmp compiles)
    "custom_optimizers": 27,  # Model._setattr_hook, Optimizer.apply / scale_loss: optimizers a custom compile keeps
    "enable.gradient_errors": 29,  # tf.GradientTape.gradient: backward-pass dtype mismatches explained
    "numerics": 30,  # Layer.call, train_step, Optimizer.apply / scale_loss
    "enable.build_errors": 31,  # Layer.compute_output_spec while enabled: build-time dtype mismatches explained
    "enable.quantize_hint": 33,  # model.quantize (a float16 model tfmp attached): the working int8 route
    "loss_scale.batch": 32,  # Model.train_step (an instance's): the batch for the "batch" guard
    "audit.outputs": 35,  # Layer.call: record output dtypes during tfmp.audit(batch=...)
    "grad_stats": 40,  # Optimizer.apply: gradient statistics for the monitor
    "fused_update": 42,  # an Adam's or SGD's update_step, during tfmp.LossScaleOptimizer's apply: one kernel
    "enable.compile": 50,  # Trainer.compile / compile_from_config while enabled
    "enable.losses": 52,  # Layer.losses (property): 16-bit loss terms of attached models cast to float32
    "loss_scale.fit_check": 55,  # Trainer.make_train_function while tfmp optimizers exist
    "enable.first_step": 60,  # Trainer.make_train_function while enabled
    "fit_lifecycle": 65,  # Trainer.fit while a LossScaleMonitor is alive: handlers of an error out of fit
    "step_scope": 68,  # model.make_{train,test,predict}_function: the model's functions run in a scope
    "saved_form": 69,  # Trainer.get_compile_config while tfmp optimizers exist: saved in Keras's form
    "train_function": 70,  # Model.make_train_function: the per-model step wrapper
}
_INSTANCE_SLOTS = PerObject("hook_slots")
_CLASS_SLOTS: Dict[int, Dict[str, "_Slot"]] = {}
_LOCK = threading.RLock()
_ABSENT = object()
_installing = threading.local()  # .hooks: what `install_all` collects in this thread


class Hook:
    """One installed hook; `remove()` takes it off its method.

    Attributes:
        owner: String. A key of `ORDER`.
        target: The class or object whose method is hooked.
        name: String. The method's name.
        active: Bool. False once removed.
    """

    def __init__(self, slot: "_Slot", owner: str, wrap: Callable[[Callable], Callable]) -> None:
        self._slot, self.owner, self.wrap, self.active = slot, owner, wrap, True

    @property
    def target(self) -> Any:
        return self._slot.target

    @property
    def name(self) -> str:
        return self._slot.name

    def remove(self) -> None:
        """Takes this hook off; the others on the same method stay composed. Idempotent.

        Raises:
            Whatever a remaining hook's ``wrap`` raises while the method is
            recomposed; this hook then stays on, and the method is unchanged.
        """
        with _LOCK:
            if self.active:
                self._slot.remove(self)
                self.active = False

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<tfmp Hook {self.owner} on {type(self.target).__name__}.{self.name}, {state}>"


class _Slot:
    """The hooks of one method of one class or object, and what they replaced."""

    def __init__(self, target: Any, name: str) -> None:
        self.target, self.name = target, name
        self.is_class = isinstance(target, type)
        self.saved = vars(target).get(name, _ABSENT)
        if self.is_class and self.saved is _ABSENT:
            raise AttributeError(
                f"tfmp hooks {name!r} on the class that defines it; "
                f"{target.__name__} does not."
            )
        self.hooks: List[Hook] = []
        self.composed: Any = None  # what the pass-through calls
        self.pass_through: Any = None  # the attribute tfmp wrote; None until then

    def _innermost(self) -> Callable:
        if self.saved is not _ABSENT:
            return self.saved
        target, name = self.target, self.name
        bound = getattr(target, name)

        def call_class_attribute(*args: Any, **kwargs: Any) -> Any:
            return getattr(type(target), name)(target, *args, **kwargs)

        functools.update_wrapper(call_class_attribute, bound)
        call_class_attribute.__signature__ = inspect.signature(bound)
        return call_class_attribute

    def set_hooks(self, hooks: List[Hook]) -> None:
        """Composes `hooks` over the innermost callable, then swaps the result in.

        Everything that can raise (a ``wrap``, the warning about a patch on top,
        which a warnings filter can make an error) runs before anything changes.
        """
        innermost = call = self._innermost()
        for hook in sorted(hooks, key=lambda h: ORDER[h.owner]):
            call = hook.wrap(call)
        foreign = self.foreign_patch() if self.pass_through is not None else None
        if foreign is not None:
            warnings.warn(
                f"Another patch ({foreign}) sits on {self.describe()} above "
                "tfmp's: tfmp's hooks run only if it calls the method it replaced. "
                "Apply that patch after tfmp.enable() is done, or before tfmp is imported.",
                RuntimeWarning, stacklevel=user_stacklevel())
        self.hooks, self.composed = hooks, call
        if self.pass_through is None:
            self.pass_through = _pass_through(self, innermost)
            _set(self.target, self.name, self.pass_through, self.is_class)

    def foreign_patch(self) -> Optional[str]:
        """The name of what another library wrote over tfmp's attribute, if anything."""
        current = vars(self.target).get(self.name, _ABSENT)
        if current is self.pass_through:
            return None
        if current is _ABSENT:
            return "deleted"
        name = getattr(current, "__qualname__", None) or type(current).__qualname__
        return f"{getattr(current, '__module__', None) or '?'}.{name}"

    def describe(self) -> str:
        if isinstance(self.target, types.ModuleType):
            return f"{self.target.__name__}.{self.name}"
        owner = self.target if self.is_class else type(self.target)
        kind = "" if self.is_class else "an instance of "
        return f"{kind}{owner.__module__}.{owner.__qualname__}.{self.name}"

    def remove(self, hook: Hook) -> None:
        remaining = [h for h in self.hooks if h is not hook]
        if remaining:
            self.set_hooks(remaining)
            return
        foreign = self.foreign_patch()
        if foreign is not None:  # warned first: a filter may make it an error
            warnings.warn(
                f"tfmp took its hooks off {self.describe()}, but another patch ({foreign}) "
                "sits on top: tfmp left a pass-through to the original method under it "
                "instead of overwriting it.",
                RuntimeWarning, stacklevel=user_stacklevel())
        self.hooks, self.composed = [], self._innermost()
        if foreign is not None:
            return
        if self.saved is _ABSENT:
            object.__delattr__(self.target, self.name)
        else:
            _set(self.target, self.name, self.saved, self.is_class)
        _slots(self.target).pop(self.name, None)


def _pass_through(slot: _Slot, original: Any) -> Any:
    """The attribute tfmp writes once per slot: it calls `slot.composed`.

    It carries the original's name, docstring and its signature, which Keras
    inspects (whether ``call`` takes ``training``, through ``__wrapped__``; a
    layer's ``__init__`` parameters, through ``inspect.getfullargspec`` in
    ``Operation.__new__``, which reads ``__signature__`` but not ``__wrapped__``).
    """
    if isinstance(original, property):
        return property(lambda obj: slot.composed.__get__(obj, type(obj)), doc=original.__doc__)
    if isinstance(original, classmethod):
        def class_pass_through(cls: type, *args: Any, **kwargs: Any) -> Any:
            return slot.composed.__get__(None, cls)(*args, **kwargs)

        return classmethod(functools.update_wrapper(class_pass_through, original.__func__))

    def pass_through(*args: Any, **kwargs: Any) -> Any:
        return slot.composed(*args, **kwargs)

    functools.update_wrapper(pass_through, original)
    with contextlib.suppress(TypeError, ValueError):  # a callable without a signature
        pass_through.__signature__ = inspect.signature(original)
    return pass_through


def _set(target: Any, name: str, value: Any, is_class: bool) -> None:
    if is_class:
        setattr(target, name, value)
    else:  # past Keras's attribute tracking, which would track a function
        object.__setattr__(target, name, value)


def _slots(target: Any) -> Dict[str, _Slot]:
    if isinstance(target, type):
        return _CLASS_SLOTS.setdefault(id(target), {})
    slots = _INSTANCE_SLOTS.get(target)
    if slots is None:
        slots = _INSTANCE_SLOTS[target] = {}
    return slots


def install(target: Any, name: str, wrap: Callable[[Callable], Callable], *, owner: str) -> Hook:
    """Hooks method `name` of `target` (a class or an object).

    Args:
        target: A class (hooks every instance; the class must define `name`
            itself, see `keras_private.defining_class`) or an object (this one
            only).
        name: String. The method's name.
        wrap: Callable ``wrap(next_call) -> call`` building the replacement from the
            callable below it in the stack.
        owner: String, a key of `ORDER`: where the hook sits in the stack.

    Returns:
        `Hook`; call `.remove()` to take it off.

    Raises:
        KeyError: `owner` is not a key of `ORDER`.
        AttributeError: `target` is a class that does not define `name` itself.
        Whatever `wrap` raises; the method and its other hooks are then unchanged.
    """
    if owner not in ORDER:
        raise KeyError(f"Unknown hook owner {owner!r}; known: {', '.join(ORDER)}.")
    with _LOCK:
        slots = _slots(target)
        slot = slots.get(name) or _Slot(target, name)
        hook = Hook(slot, owner, wrap)
        slot.set_hooks(slot.hooks + [hook])  # raises before anything changes
        slots[name] = slot
        collecting = getattr(_installing, "hooks", None)
        if collecting is not None:
            collecting.append(hook)
        return hook


def install_all(installers: Sequence[Callable[[], Any]]) -> List[Hook]:
    """Runs each installer; every hook they install through `install` stays, or none.

    Args:
        installers: Sequence of callables without arguments, each installing hooks
            through `install`.

    Returns:
        List of every `Hook` installed, in order.

    Raises:
        Whatever an installer raises, after removing every hook installed before it
        (also those of an installer that installed some and then raised).
    """
    outer = getattr(_installing, "hooks", None)
    _installing.hooks = hooks = []
    try:
        for installer in installers:
            installer()
    except BaseException:
        for hook in reversed(hooks):
            with contextlib.suppress(Exception):  # take the others off all the same
                hook.remove()
        raise
    finally:
        _installing.hooks = outer
    if outer is not None:
        outer.extend(hooks)
    return hooks


def installed(target: Any, name: Optional[str] = None) -> List[Hook]:
    """The active hooks on `target` (on its method `name`, or on all), innermost first."""
    with _LOCK:
        slots = _slots(target) if isinstance(target, type) else _INSTANCE_SLOTS.get(target, {})
        chosen = [slots[name]] if name in slots else ([] if name else list(slots.values()))
        return [h for slot in chosen for h in sorted(slot.hooks, key=lambda h: ORDER[h.owner])]
