"""Griffe extension for the API reference: tfmp's docstrings head their doctests
"Example:", which Griffe's Google parser reads as an admonition; as "Examples:" the
doctest lines render as code (and brackets in them are not taken for links)."""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.M)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
