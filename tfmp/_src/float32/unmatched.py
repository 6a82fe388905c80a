"""`tfmp.UnmatchedTargetWarning`: a keep or exclude target that matched no layer of its model.

A target given with one model or session that selects no layer changes nothing (a
misspelt pattern): it is named once per model and target, with the closest pattern.
Judged once no layer with a ``build`` of its own still waits for its build hook.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import weakref
from typing import Any, Container, Iterable, List, Sequence, Set, Tuple

import keras

from tfmp._src.errors import did_you_mean, warn
from tfmp._src.float32 import registry as _registry
from tfmp._src.keras_hooks.object_state import PerObject
from tfmp._src.layer_tree import walk

#: How many of the model's layer paths (or classes) a warning lists.
SHOWN = 5

_CHECKS = PerObject("unmatched_check")  # model -> _Check, while some layer is unbuilt
_WAITING = PerObject("unmatched_waiting")  # unbuilt layer -> {id(model): (weakref to model, path)}
_WARNED = PerObject("unmatched_warned")  # model -> set of (argument, target) already named


class UnmatchedTargetWarning(UserWarning):
    """A keep or exclude target matched no layer of the model it was given for.

    Warned once per model and target by `tfmp.force_float32` (or ``compile()``
    under `tfmp.enable`) for a ``keep``/``exclude`` (``keep_float32``/``exclude_float32``)
    target that selects no layer; layers with their own ``build`` are judged once
    built. The message names the target, a few layer paths, a "Did you mean ...?"
    and the fix. Targets registered with `tfmp.register_float32` are not checked.

    Make it an error with ``warnings.simplefilter("error", tfmp.UnmatchedTargetWarning)``.
    """


@dataclasses.dataclass
class _Check:
    """One model's call-level targets still unmatched, and the builds that may match them."""

    unmatched: List[Tuple[str, Any]]  # (argument name, target)
    pending: Set[int]  # ids of the model's layers whose deferred build has not run


def _matched(target: Any, entries: Iterable[Tuple[str, Any, Any]]) -> bool:
    return any(_registry.matches(layer, path, (target,)) for path, layer, _ in entries)


def check(
    model: keras.Model,
    targets: Sequence[Tuple[str, Tuple[Any, ...]]],
    entries: Sequence[Tuple[str, Any, Any]],
    deferred: Container[Any],
) -> None:
    """Judges ``model``'s ``(argument name, targets)`` pairs once forcing it finished (replacing an earlier check).

    Warns `UnmatchedTargetWarning` once none of the ``deferred`` builds could match a target.
    """
    unmatched = list(dict.fromkeys(
        (argument, target) for argument, given in targets for target in given
        if not _matched(target, entries)))
    found = _Check(unmatched, set())
    _CHECKS[model] = found
    _wait(model, found, [("", model)] + [(path, layer) for path, layer, _ in entries], deferred)
    _judge(model, found)


def after_build(layer: keras.layers.Layer, deferred: Container[Any]) -> None:
    """Matches the sublayers ``layer``'s deferred build created; a model's last pending build judges."""
    for model_ref, path in _WAITING.pop(layer, {}).values():
        model = model_ref()
        found = None if model is None else _CHECKS.get(model)
        if found is None or id(layer) not in found.pending:
            continue
        found.pending.discard(id(layer))
        entries = walk(layer, path)
        found.unmatched = [(a, t) for a, t in found.unmatched if not _matched(t, entries)]
        _wait(model, found, [(p, sub) for p, sub, _ in entries], deferred)
        _judge(model, found)


def _wait(model: keras.Model, found: _Check, layers: Sequence[Tuple[str, Any]],
          deferred: Container[Any]) -> None:
    """Records which of ``layers`` the judgement of ``model`` waits for."""
    if not found.unmatched:
        return
    for path, layer in layers:
        if layer in deferred and type(layer).build is not keras.layers.Layer.build:  # Keras's build creates nothing
            found.pending.add(id(layer))
            _WAITING.setdefault(layer, {})[id(model)] = (weakref.ref(model), path)


def _judge(model: keras.Model, found: _Check) -> None:
    """Warns for each target still unmatched once no deferred build is pending."""
    if found.pending and found.unmatched:
        return
    _CHECKS.pop(model, None)
    if not found.unmatched:
        return
    warned = _WARNED.setdefault(model, set())
    entries = walk(model)
    for argument, target in found.unmatched:
        if (argument, target) in warned:
            continue
        warned.add((argument, target))
        warn(*message(model, argument, target, entries), UnmatchedTargetWarning, section="unmatched-targets")


def message(model: keras.Model, argument: str, target: Any,
            entries: Sequence[Tuple[str, Any, Any]]) -> Tuple[str, str, str]:
    """The warning's (what, expected, fix) lines for ``target``, given as ``argument``, matching none of ``entries``."""
    paths = [path for path, _, _ in entries]
    count = f"{len(paths)} layer{'s' if len(paths) != 1 else ''}"
    if isinstance(target, str):
        shown = sorted(paths, key=lambda path: path.count("/"))[:SHOWN]
        expected = f"a layer-path glob pattern, such as {', '.join(map(repr, shown))} ({count})"
        fix = (_class_note(target, entries) or _case_note(target, paths)
               or did_you_mean(target, _close_patterns(target, paths))
               or "Correct the pattern to match a layer path, or leave it out.")
    else:
        classes = list(dict.fromkeys(type(layer).__name__ for _, layer, _ in entries))
        expected = (f"a Layer class the model uses, such as {', '.join(classes[:SHOWN])}"
                    f"{', ...' if len(classes) > SHOWN else ''} ({count})")
        fix = "Pass a class the model uses, or a layer-path pattern."
    if argument.endswith("_float32"):
        fix += " Or tfmp.register_float32 it: not checked per model."
    return (f"A target in `{argument}` matches no layer of model {model.name!r}. Received: {argument}={target!r}.",
            f"Expected {expected}; tfmp.audit(model) lists them.", fix)


def _class_note(pattern: str, entries: Sequence[Tuple[str, Any, Any]]) -> str:
    """The fix when ``pattern`` names a class of some layer of the model (pass the class itself)."""
    for _, layer, _ in entries:
        for cls in type(layer).__mro__:
            if cls.__name__ == pattern and issubclass(cls, keras.layers.Layer):
                module = "keras.layers" if getattr(keras.layers, pattern, None) is cls else cls.__module__
                return (f"A string is a layer-path pattern; {pattern!r} names a class. Pass the "
                        f"class itself: {module}.{pattern}.")
    return ""


def _case_note(pattern: str, paths: Sequence[str]) -> str:
    """The fix when ``pattern`` matches some path once case is ignored, else ``""``."""
    matched = [path for path in paths if fnmatch.fnmatchcase(path.lower(), pattern.lower())]
    if not matched:
        return ""
    if not any(sign in pattern for sign in "*?["):
        return f"Did you mean {matched[0]!r}? (Patterns are case-sensitive.)"
    return (f"Patterns are case-sensitive: ignoring case it would match {len(matched)} "
            f"layer{'s' if len(matched) != 1 else ''}, e.g. {matched[0]!r}.")


#: How many characters a suggested pattern's fixed part may differ in length from the one typed.
LENGTH_SLACK = 2


def _close_patterns(pattern: str, paths: Sequence[str]) -> List[str]:
    """Patterns matching some layer, for `did_you_mean`: the paths, and for a leading (trailing) ``*`` each path's
    trailing (leading) ``/`` parts and its endings (beginnings) about as long as the typed one."""
    candidates = dict.fromkeys(paths)
    for path in paths:
        parts = path.split("/")
        if pattern.startswith("*"):
            candidates.update(dict.fromkeys("*" + "/".join(parts[i:]) for i in range(len(parts))))
            candidates.update(dict.fromkeys("*" + path[-n:] for n in _lengths(pattern[1:], path)))
        if pattern.endswith("*"):
            candidates.update(dict.fromkeys("/".join(parts[:i]) + "/*" for i in range(1, len(parts))))
            candidates.update(dict.fromkeys(path[:n] + "*" for n in _lengths(pattern[:-1], path)))
    return list(candidates)


def _lengths(fixed: str, path: str) -> range:
    """Lengths within `LENGTH_SLACK` of ``fixed``'s, at least 1 and shorter than ``path``."""
    return range(max(1, len(fixed) - LENGTH_SLACK), min(len(path), len(fixed) + LENGTH_SLACK + 1))
