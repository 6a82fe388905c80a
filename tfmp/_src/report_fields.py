"""Field checks of tfmp's result types (reports and device facts), run by their constructors.

tfmp's calls build these objects, but a user may build one too (`tfmp.DeviceFacts`
to decide for another machine, a report in a test of their own). A field of the
wrong type would otherwise be accepted and fail later, far from the mistake (in
``str(report)`` or in a policy decision), so each result type's ``__post_init__``
checks its fields here and refuses a wrong one in the project's template, naming
the field.

A `Kind` says which values a field takes and how the message words it::

    check_fields(self, path=STRING, size_bytes=COUNT, notes=tuple_of(STRING))
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Type

from tfmp._src.errors import invalid_argument


@dataclasses.dataclass(frozen=True)
class Kind:
    """The values one field accepts.

    Attributes:
        expected: String. What is accepted, as the template's "Expected ..." phrase.
        accepts: Callable taking the value, returning True when it is accepted.
    """

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
FINITE = Kind("a finite number", lambda value: _is_real(value) and math.isfinite(value))
COUNT = Kind("an integer >= 0", _is_count)
POSITIVE_INT = Kind("an integer >= 1", lambda value: _is_count(value) and value >= 1)
ANY = Kind("any value", lambda value: True)
INT = Kind("an integer", lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool))


def optional(kind: Kind) -> Kind:
    """`kind` or None."""
    return Kind(f"None or {kind.expected}", lambda value: value is None or kind.accepts(value))


def one_of(*choices: str) -> Kind:
    """One of the strings `choices`."""
    return Kind("one of " + ", ".join(map(repr, choices)),
                lambda value: isinstance(value, str) and value in choices)


def instance_of(cls: Type, name: str) -> Kind:
    """An instance of `cls`, called `name` in the message (e.g. ``"a tfmp.GpuFacts"``)."""
    return Kind(name, lambda value: isinstance(value, cls))


def _sequence_of(container: Any, word: str, kind: Kind) -> Kind:
    return Kind(f"a {word} whose items are each {kind.expected}",
                lambda value: isinstance(value, container) and all(kind.accepts(v) for v in value))


def tuple_of(kind: Kind) -> Kind:
    """A tuple whose every item is of `kind`."""
    return _sequence_of(tuple, "tuple", kind)


def list_of(kind: Kind) -> Kind:
    """A list whose every item is of `kind`."""
    return _sequence_of(list, "list", kind)


def dict_of(key: Kind, value: Kind) -> Kind:
    """A dict whose keys are of `key` and values of `value`."""
    return Kind(f"a dict whose keys are each {key.expected} and values each {value.expected}",
                lambda data: isinstance(data, dict)
                and all(key.accepts(k) and value.accepts(v) for k, v in data.items()))


def check_fields(owner: Any, **kinds: Kind) -> None:
    """Checks fields of the dataclass instance `owner` against `kinds`.

    Args:
        owner: Dataclass instance whose fields are read with `getattr`.
        **kinds: `Kind` per field name.

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

