"""Method hooks: installed, composed and removed in one place.

Every method tfmp replaces on a Keras or TensorFlow class, object or module goes
through a `Surface`, made by the module of `tfmp._src.keras_hooks` that owns
that surface (see `surfaces`). Per method of an object there is one *slot*
holding the method as it was and a stack of hooks; the attribute is the
composition of the stack, innermost first in the order of its surface's
`Surface.subscribers`. Removing a hook rebuilds the composition from the
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
from tfmp._src.keras_hooks import versions  # noqa: F401 (an unsupported pair fails at import)
from tfmp._src.keras_hooks.object_state import PerObject

_INSTANCE_SLOTS = PerObject("hook_slots")
_CLASS_SLOTS: Dict[int, Dict[str, "_Slot"]] = {}
_LOCK = threading.RLock()
_ABSENT = object()
_installing = threading.local()  # .hooks: what `install_all` collects in this thread


class Hook:
    """One installed hook; `remove()` takes it off its method.

    Attributes:
        owner: String. The subscriber: one of its surface's `Surface.subscribers`.
        surface: `Surface`. The surface the hooked method belongs to.
        target: The class or object whose method is hooked.
        name: String. The method's name.
        active: Bool. False once removed.
    """

    def __init__(self, slot: "_Slot", surface: "Surface", owner: str, wrap: Callable[[Callable], Callable]) -> None:
        self._slot, self.surface, self.owner, self.wrap, self.active = slot, surface, owner, wrap, True
        self.rank = surface.subscribers.index(owner)

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
        for hook in sorted(hooks, key=lambda h: h.rank):
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
        _forget_slot(self.target, self.name)


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
        permanent = slot.is_class or isinstance(slot.target, types.ModuleType)  # Keras's own function
        pass_through.__signature__ = _signature(original) if permanent else inspect.signature(original)
    return pass_through


@functools.lru_cache(maxsize=256)
def _signature(function: Callable) -> inspect.Signature:
    """The signature of a class's or module's function, read once: the model-level hooks go on
    and off at each outermost call of an attached model, each time with a new pass-through."""
    return inspect.signature(function)


def _set(target: Any, name: str, value: Any, is_class: bool) -> None:
    if is_class:
        setattr(target, name, value)
    else:  # past Keras's attribute tracking, which would track a function
        object.__setattr__(target, name, value)


def _slots(target: Any) -> Dict[str, _Slot]:
    """The slots of `target` (method name -> slot); empty and not stored when it has none."""
    if isinstance(target, type):
        return _CLASS_SLOTS.get(id(target), {})
    return _INSTANCE_SLOTS.get(target, {})


def _store_slot(slot: _Slot) -> None:
    if slot.is_class:
        _CLASS_SLOTS.setdefault(id(slot.target), {})[slot.name] = slot
    else:
        slots = _INSTANCE_SLOTS.get(slot.target)
        if slots is None:
            slots = _INSTANCE_SLOTS[slot.target] = {}
        slots[slot.name] = slot


def _forget_slot(target: Any, name: str) -> None:
    """Drops `target`'s slot `name`; with its last slot, `target` keeps nothing of tfmp."""
    slots = _slots(target)
    slots.pop(name, None)
    if not slots:
        if isinstance(target, type):
            _CLASS_SLOTS.pop(id(target), None)
        else:
            _INSTANCE_SLOTS.pop(target, None)


class Surface:
    """One surface of Keras or TensorFlow that tfmp hooks: its methods and their subscribers.

    A surface module of `tfmp._src.keras_hooks` (`trainer`, `layer_calls`,
    `optimizer_steps`, `loss_terms`, `backend_ops`, `gradient_tape`) makes one;
    features subscribe through it and never install a hook themselves. Several
    subscribers of one method compose in the order of `subscribers`, innermost
    first, whatever order they subscribed in.

    Args:
        name: String, the surface's name (e.g. ``"layer calls"``).
        methods: Sequence of strings, the method names it hooks.
        subscribers: Sequence of strings, the owners allowed to subscribe,
            innermost first.
    """

    def __init__(self, name: str, methods: Sequence[str], subscribers: Sequence[str]) -> None:
        self.name, self.methods, self.subscribers = name, tuple(methods), tuple(subscribers)

    def subscribe(self, target: Any, method: str, wrap: Callable[[Callable], Callable], *, owner: str) -> Hook:
        """Hooks `method` of `target` (a class or an object) for subscriber `owner`.

        Args:
            target: A class (hooks every instance; the class must define `method`
                itself, see `defining_class`) or an object (this one only).
            method: String, one of `methods`.
            wrap: Callable ``wrap(next_call) -> call`` building the replacement from the
                callable below it in the stack.
            owner: String, one of `subscribers`: where the hook sits in the stack.

        Returns:
            `Hook`; call `.remove()` to take it off.

        Raises:
            KeyError: `method` is not one of this surface's, or `owner` not one of its subscribers.
            RuntimeError: the method of `target` is already hooked through another surface.
            AttributeError: `target` is a class that does not define `method` itself.
            Whatever `wrap` raises; the method and its other hooks are then unchanged.
        """
        if method not in self.methods:
            raise KeyError(f"{method!r} is not a method of the {self.name} surface; its methods: "
                           f"{', '.join(self.methods)}.")
        if owner not in self.subscribers:
            raise KeyError(f"Unknown hook owner {owner!r} on the {self.name} surface; known: "
                           f"{', '.join(self.subscribers)}.")
        with _LOCK:
            slot = _slots(target).get(method) or _Slot(target, method)
            if slot.hooks and slot.hooks[0].surface is not self:
                raise RuntimeError(f"{slot.describe()} is hooked through the {slot.hooks[0].surface.name} "
                                   f"surface, not the {self.name} one.")
            hook = Hook(slot, self, owner, wrap)
            slot.set_hooks(slot.hooks + [hook])  # raises before anything changes
            _store_slot(slot)
            collecting = getattr(_installing, "hooks", None)
            if collecting is not None:
                collecting.append(hook)
            return hook

    def subscriptions(self, target: Any, method: Optional[str] = None) -> List[Hook]:
        """The active hooks of this surface on `target` (on `method`, or on all), innermost first."""
        return [hook for hook in installed(target, method) if hook.surface is self]

    def subscribed(self, target: Any, method: str, owner: str) -> bool:
        """Bool. Whether `owner` has a hook on `method` of `target`."""
        return any(hook.owner == owner for hook in self.subscriptions(target, method))

    def unsubscribe(self, target: Any, method: str, owner: str) -> None:
        """Takes `owner`'s hooks off `method` of `target`; the others stay composed. Idempotent."""
        for hook in self.subscriptions(target, method):
            if hook.owner == owner:
                hook.remove()

    def __repr__(self) -> str:
        return f"<tfmp Surface {self.name}: {', '.join(self.methods)}>"


def defining_class(cls: type, name: str) -> type:
    """The class in `cls.__mro__` whose own namespace defines `name`.

    A class-level hook goes where the method is defined: the compile hook on
    Keras's trainer base class, not on `keras.Model`, because Keras's
    ``compile_from_config`` treats a model whose ``compile`` differs from the
    trainer's as user-overridden and skips compiling.

    Raises:
        AttributeError: No class of the MRO defines `name`.
    """
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    raise AttributeError(f"No class in the MRO of {cls.__name__} defines {name!r}.")


def install_all(installers: Sequence[Callable[[], Any]]) -> List[Hook]:
    """Runs each installer; every hook they install through `install` stays, or none.

    Args:
        installers: Sequence of callables without arguments, each installing hooks
            through `Surface.subscribe`.

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


def class_slots() -> List[Dict[str, _Slot]]:
    """The slots of every hooked class, one dict (method name to slot) per class."""
    with _LOCK:
        return [dict(slots) for slots in _CLASS_SLOTS.values()]


def installed(target: Any, name: Optional[str] = None) -> List[Hook]:
    """The active hooks on `target` (on its method `name`, or on all), innermost first."""
    with _LOCK:
        slots = _slots(target)
        chosen = [slots[name]] if name in slots else ([] if name else list(slots.values()))
        return [h for slot in chosen for h in sorted(slot.hooks, key=lambda h: h.rank)]
