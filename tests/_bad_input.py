"""What the property-based tests of bad input share (tests/test_bad_input*.py).

Every public name of `tfmp.__all__` is called with wrong types and values drawn by
hypothesis. Each call must either refuse the value with the project's template
error (tfmp/_src/errors.py: "Invalid `name` argument. Expected ... Received:
name=... (of type ...). <how to fix>"), naming the argument it was given in and
saying how to fix it, or do the right thing, which the test then checks. A raw
error from inside (AttributeError, TypeError from TensorFlow, a graph error) or a
nonsense value accepted in silence fails the test.

A test states which public names it covers with `@covers(...)`;
`test_bad_input_covers_every_public_name` (tests/test_bad_input.py) checks that
the tests together cover all of `tfmp.__all__`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: Settings of every bad-input property test: the same examples on every run
#: (derandomized, no example database written into the checkout), no deadline
#: (a first call traces a TensorFlow function), few examples (each may build a
#: model), fixtures of the module shared between examples on purpose.
BAD_INPUT_SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: The modules whose `@covers` marks count (tests/test_bad_input*.py).
COVERING_MODULES = ("test_bad_input", "test_bad_input_tools")


def covers(*names: str) -> Callable:
    """Marks a test as checking bad input to the public names `names` (``tfmp.<name>``)."""

    def mark(test: Callable) -> Callable:
        test.covers_public_names = frozenset(names) | getattr(test, "covers_public_names", frozenset())
        return test

    return mark


def covered_names(modules: Iterable[Any]) -> set:
    """The public names that the `@covers` marks of the tests in `modules` name."""
    names: set = set()
    for module in modules:
        for value in vars(module).values():
            names |= set(getattr(value, "covers_public_names", ()))
    return names


def template_pattern(argument: str) -> str:
    """Regular expression of the template error for `argument` (for `pytest.raises(match=)`)."""
    return rf"Invalid `{re.escape(argument)}` argument\. Expected .+ Received: {re.escape(argument)}="


#: The template's received part, then a sentence: the fix (or "Did you mean ...?").
FIX_AFTER_RECEIVED = re.compile(r"\(of type \w+\)\. \S")


def assert_refused(call: Callable[[], Any], argument: str) -> BaseException:
    """Calls `call` and checks that it raises the template error naming `argument`, with a fix.

    Returns:
        The error raised, for further checks.
    """
    with pytest.raises((ValueError, TypeError), match=template_pattern(argument)) as info:
        call()
    assert FIX_AFTER_RECEIVED.search(str(info.value)), f"no fix after what was received: {info.value}"
    # A phrase said twice, as "Expected a CommunicationOptions or None or None".
    assert not DOUBLED.search(str(info.value).split("Received:")[0]), f"a phrase said twice: {info.value}"
    return info.value


DOUBLED = re.compile(r"\b(\w+(?: \w+)?) (?:or |and )?\1\b")


# Wrong values, by kind. Each strategy draws values that no argument of the kind
# accepts; a test combines the kinds that are wrong for the argument it checks.
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NEGATIVE_OR_ZERO_INTS = st.integers(max_value=0)
NON_STRINGS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.builds(object),
)
NON_NUMBERS = st.one_of(
    st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.builds(object),
)
NON_BOOLS = st.one_of(
    st.integers(), st.floats(allow_nan=False), st.text(max_size=5), st.lists(st.booleans(), max_size=2),
    st.builds(object),
)
NOT_MODELS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5),
    st.lists(st.integers(), max_size=3), st.builds(object),
)
