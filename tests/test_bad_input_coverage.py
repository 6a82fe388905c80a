"""The bad-input property tests (tests/test_bad_input*.py) cover every public name."""

import importlib

import tfmp
from _bad_input import COVERING_MODULES, covered_names


def test_bad_input_covers_every_public_name():
    modules = [importlib.import_module(name) for name in COVERING_MODULES]
    covered = covered_names(modules)
    public = set(tfmp.__all__) - {"__version__"}
    assert public - covered == set(), f"public names without a bad-input test: {sorted(public - covered)}"
    assert covered - public == set(), f"`@covers` names that are not public: {sorted(covered - public)}"
