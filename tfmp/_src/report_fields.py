"""Field checks of tfmp's result types (reports and device facts), run by their constructors.

A user may build a result too (a `tfmp.DeviceFacts` for another machine); a field of the
wrong type is refused there, naming it, not later far from the mistake. A `Kind` says which
values a field takes: ``check_fields(self, path=STRING, notes=tuple_of(STRING))``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Type

from tfmp._src.errors import invalid_argument


@dataclasses.dataclass(frozen=True)
class Kind:
    """The values one field `accepts`, and the template's "Expected ..." phrase for them."""

    expected: str
    accepts: Callable[[Any], bool]


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


STRING = Kind("a string", lambda value: isinstance(value, str))
BOOL = Kind("True or False", lambda value: isinstance(value, bool))
#: Any real number, NaN and Inf included (a measured difference may be NaN).
REAL = Kind("a number", _is_real)
COUNT = Kind("an integer >= 0", _is_count)
POSITIVE_INT = Kind("an integer >= 1", lambda value: _is_count(value) and value >= 1)
ANY = Kind("any value", lambda value: True)
INT = Kind("an integer", lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool))


def optional(kind: Kind) -> Kind:
    return Kind(f"None or {kind.expected}", lambda value: value is None or kind.accepts(value))


def one_of(*choices: str) -> Kind:
    return Kind("one of " + ", ".join(map(repr, choices)),
                lambda value: isinstance(value, str) and value in choices)


def instance_of(cls: Type, name: str) -> Kind:
    """An instance of `cls`, called `name` in the message (e.g. ``"a tfmp.GpuFacts"``)."""
    return Kind(name, lambda value: isinstance(value, cls))


def _sequence_of(container: Any, word: str, kind: Kind) -> Kind:
    return Kind(f"a {word} whose items are each {kind.expected}",
                lambda value: isinstance(value, container) and all(kind.accepts(v) for v in value))


def tuple_of(kind: Kind) -> Kind:
    return _sequence_of(tuple, "tuple", kind)


def list_of(kind: Kind) -> Kind:
    return _sequence_of(list, "list", kind)


def dict_of(key: Kind, value: Kind) -> Kind:
    return Kind(f"a dict whose keys are each {key.expected} and values each {value.expected}",
                lambda data: isinstance(data, dict)
                and all(key.accepts(k) and value.accepts(v) for k, v in data.items()))


def check_fields(owner: Any, **kinds: Kind) -> None:
    """Checks fields of the dataclass instance `owner` against `kinds` (a `Kind` per field name).

    Raises:
        ValueError: (template) the first field whose value its kind does not
            accept, named as the constructor argument.
    """
    cls = type(owner).__name__
    for name, kind in kinds.items():
        value = getattr(owner, name)
        if not kind.accepts(value):
            raise invalid_argument(name, value, kind.expected,
                                   fix=f"Pass {name} as {cls}'s docstring describes it.")

