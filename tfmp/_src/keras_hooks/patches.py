"""Method hooks: installed, composed and removed in one place, through a `Surface`.

Per method of a class, object or module there is one slot: the method as it was and a stack of hooks
(``wrap(next_call) -> call``) composed innermost first in the surface's subscriber order; instance
hooks sit above class hooks. tfmp writes the attribute twice at most (a pass-through on the first
hook, the original back after the last); recomposing happens first, so a ``wrap`` that raises
changes nothing. A patch another library put on top is never overwritten: tfmp warns, naming it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Sequence

from tfmp._src.errors import warn
from tfmp._src.keras_hooks import versions  # noqa: F401 (an unsupported pair fails at import)
from tfmp._src.keras_hooks.object_state import PerObject

_INSTANCE_SLOTS = PerObject("hook_slots")
_CLASS_SLOTS: Dict[int, Dict[str, "_Slot"]] = {}
_LOCK = threading.RLock()
_ABSENT = object()
_installing = threading.local()  # .hooks: what `install_all` collects in this thread


class Hook:
    """One installed hook of `owner` (a subscriber of `surface`) on `target`'s method `name`."""

    def __init__(self, slot: "_Slot", surface: "Surface", owner: str, wrap: Callable[[Callable], Callable]) -> None:
        self._slot, self.surface, self.owner, self.wrap, self.active = slot, surface, owner, wrap, True
        self.target, self.name, self.rank = slot.target, slot.name, surface.subscribers.index(owner)

    def remove(self) -> None:
        """Takes this hook off, the others staying composed; idempotent (a raising ``wrap`` leaves it on)."""
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
            raise AttributeError(f"tfmp hooks {name!r} on the class that defines it; {target.__name__} does not.")
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
        """Composes `hooks` over the innermost callable, then swaps it in (whatever can raise runs first)."""
        innermost = call = self._innermost()
        for hook in sorted(hooks, key=lambda h: h.rank):
            call = hook.wrap(call)
        foreign = self.foreign_patch() if self.pass_through is not None else None
        if foreign is not None:
            warn(f"Another patch ({foreign}) sits on {self.describe()} above tfmp's.",
                 "tfmp's hooks run only if that patch calls the method it replaced.",
                 "Fix: apply that patch after tfmp.enable() is done, or before tfmp is imported.",
                 RuntimeWarning, section="another-library-patches-keras")
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
            warn(f"tfmp took its hooks off {self.describe()}, under another patch ({foreign}).",
                 "tfmp left a pass-through to the original method under it instead of overwriting it.",
                 "Fix: nothing to do; to have the original method back, take that patch off first.",
                 RuntimeWarning, section="another-library-patches-keras")
        self.hooks, self.composed = [], self._innermost()
        if foreign is not None:
            return
        if self.saved is _ABSENT:
            object.__delattr__(self.target, self.name)
        else:
            _set(self.target, self.name, self.saved, self.is_class)
        _forget_slot(self.target, self.name)


def _pass_through(slot: _Slot, original: Any) -> Any:
    """The attribute tfmp writes once per slot, calling `slot.composed`.

    It carries the original's name, docstring and signature, which Keras inspects (``call``'s
    ``training`` via ``__wrapped__``; ``__init__``'s parameters via ``getfullargspec`` in
    ``Operation.__new__``, which reads ``__signature__`` only).
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
    """The signature of a class's or module's function, read once (the model-level hooks come and go often)."""
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
        _INSTANCE_SLOTS.setdefault(slot.target, {})[slot.name] = slot


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
    """One surface tfmp hooks: its `methods`, hooked only by its `subscribers`, composed innermost first."""

    def __init__(self, name: str, methods: Sequence[str], subscribers: Sequence[str]) -> None:
        self.name, self.methods, self.subscribers = name, tuple(methods), tuple(subscribers)

    def subscribe(self, target: Any, method: str, wrap: Callable[[Callable], Callable], *, owner: str) -> Hook:
        """Hooks `method` of `target` (a class defining it itself, or one object) with ``wrap(next_call)``.

        Raises KeyError for a `method` or `owner` not of this surface, RuntimeError when the method is
        hooked through another surface, AttributeError for a class not defining `method`, and what
        `wrap` raises (nothing changed then).
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
    """The class in `cls.__mro__` defining `name` itself (AttributeError if none).

    A class hook goes there: Keras's ``compile_from_config`` skips compiling a model whose
    ``compile`` differs from the trainer's.
    """
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    raise AttributeError(f"No class in the MRO of {cls.__name__} defines {name!r}.")


def install_all(installers: Sequence[Callable[[], Any]]) -> List[Hook]:
    """Runs each installer; every `Hook` they subscribe stays (returned in order), or none.

    What an installer raises propagates after every hook installed so far is removed.
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
