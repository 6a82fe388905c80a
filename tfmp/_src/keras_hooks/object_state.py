"""State tfmp keeps for one Keras object, on the object itself.

A `weakref.WeakKeyDictionary` would keep an object alive for ever once its value refers back to
it (a `patches.Hook` refers to its slot, the slot to its target). Kept in the object's own
``__dict__``, past Keras's tracking (neither tracked nor saved), the state dies with the object.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_ABSENT = object()


class PerObject:
    """A mapping from Keras objects to one kind of tfmp state, stored on each as ``_tfmp_<name>``."""

    def __init__(self, name: str) -> None:
        self.attribute = f"_tfmp_{name}"

    def __contains__(self, obj: Any) -> bool:
        return self.attribute in vars(obj)

    def get(self, obj: Any, default: Any = None) -> Any:
        return vars(obj).get(self.attribute, default)

    def __setitem__(self, obj: Any, value: Any) -> None:
        object.__setattr__(obj, self.attribute, value)

    def setdefault(self, obj: Any, default: Any) -> Any:
        if self.attribute not in vars(obj):
            self[obj] = default
        return vars(obj)[self.attribute]

    def pop(self, obj: Any, default: Any = _ABSENT) -> Any:
        """Removes and returns `obj`'s state; `default` (or KeyError) when it has none."""
        if self.attribute in vars(obj):
            value = vars(obj)[self.attribute]
            object.__delattr__(obj, self.attribute)
            return value
        if default is _ABSENT:
            raise KeyError(f"{type(obj).__name__} has no {self.attribute}")
        return default


class PerObjectHooks(PerObject):
    """A `PerObject` whose one value per object has a ``remove()``; `replace` and `discard` share one lock."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._lock = threading.RLock()

    def replace(self, obj: Any, make: Callable[[], Any]) -> None:
        """Takes `obj`'s value off, then stores ``make()`` (whatever it raises leaves none)."""
        with self._lock:
            self.discard(obj)
            self[obj] = make()

    def discard(self, obj: Any) -> None:
        """Takes `obj`'s value off (its ``remove()``), nothing when it has none."""
        with self._lock:
            value = self.pop(obj, None)
            if value is not None:
                value.remove()
