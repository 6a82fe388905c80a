"""tfmp's error types, the one message template every check uses (STYLE.md, rule 4)::

    Invalid `policy` argument. Expected one of 'auto', 'mixed_float16',
    'mixed_bfloat16', 'float32'. Received: policy='fp16' (of type str).
    Did you mean 'mixed_float16'?

and the one form of every warning (`warn`) and of a longer error's opening (`opening`): what
happened, the cause in this model, the fix, one short line each, then the guide's section::

    tfmp skipped step 3 (1 of 4 steps since step 0; scale 32768): nothing written.
    The loss itself is non-finite (nan; float16 holds at most 65504): a lower loss scale cannot help.
    Fix: tfmp.check_numerics(model) finds the first non-finite layer, or lower the learning rate; under XLA, check labels.
    Guide: .../site-packages/tfmp/docs/troubleshooting.md#nan-or-inf-loss
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import sys
import warnings
from typing import Any, Iterable, Optional

from tfmp._src.constants import TROUBLESHOOTING_GUIDE


class NonFiniteError(FloatingPointError):
    """A tensor in training became NaN or Inf and tfmp stopped the run.

    Attributes:
        layer: String or None. Path of the first layer found non-finite
            (e.g. ``"model/dense_1"``), None when the value is not tied to a layer
            (e.g. a non-finite loss seen by the optimizer).
        phase: String or None. ``"forward"`` (layer outputs), ``"backward"``
            (gradients after unscaling), or what the loss-scale optimizer saw:
            ``"batch"``, ``"loss"``, ``"gradients"``, ``"values"`` (a value
            the update would write) or ``"scale"`` (a loss scale no run reaches).
        step: Int or None. Zero-based training step at which it was seen.
        kind: String or None. ``"nan"``, ``"inf"`` or ``"nan+inf"``.
        details: Dict. Extra facts for programs (scale, value ranges, trace).

    Raises:
        ValueError: (template) `layer`, `phase` or `kind` is neither None nor a
            string, `step` neither None nor an int, `details` neither None nor
            a dict.
    """

    def __init__(
        self,
        message: str,
        *,
        layer: Optional[str] = None,
        phase: Optional[str] = None,
        step: Optional[int] = None,
        kind: Optional[str] = None,
        details: Optional[dict] = None,
    ) -> None:
        for name, value, types, expected, example in (
            ("layer", layer, str, "a string", "'model/dense_1'"),
            ("phase", phase, str, "a string", "'forward'"),
            ("kind", kind, str, "a string", "'nan'"),
            ("step", step, int, "an int", "3"),
            ("details", details, dict, "a dict", "{'scale': 1024.0}"),
        ):
            check_type(name, value, types, expected, allow_none=True, fix=f"Pass e.g. {name}={example}, or None.")
        super().__init__(message)
        self.layer = layer
        self.phase = phase
        self.step = step
        self.kind = kind
        self.details = dict(details or {})


#: Int. Most lines of a message's opening before its guide line (what, cause, fix).
OPENING_LINES = 3
#: Int. Most characters of one opening line, with short layer and model names (tests/test_messages.py).
LINE_LENGTH = 120
#: String. How the line naming the guide starts.
GUIDE_PREFIX = "Guide: "


def guide(section: str) -> str:
    """The troubleshooting guide shipped with tfmp at `section` (a heading's anchor, e.g. ``"no-speed-up"``)."""
    return f"{TROUBLESHOOTING_GUIDE}#{section}"


def opening(what: str, cause: str, fix: str, section: str, details: str = "") -> str:
    """A message in tfmp's one form: `what` happened, its `cause` in this model, the `fix` (one line each;
    `cause` may be "" when `what` says it), then ``Guide: <troubleshooting.md>#<section>``; `details` (e.g.
    a trace) follow below it."""
    lines = [line for line in (what, cause, fix) if line] + [GUIDE_PREFIX + guide(section)]
    return "\n".join(lines + ([details] if details else []))


def warn(what: str, cause: str, fix: str, category: type, *, section: str, stacklevel: Optional[int] = None,
         details: str = "") -> None:
    """Warns `category` with the text `opening` builds; the one door of every tfmp warning.

    `stacklevel` None names the user's line (`user_stacklevel`), else counts from the caller of `warn`;
    `details` (text of any length, e.g. an error's) follow the guide line.
    """
    level = user_stacklevel() if stacklevel is None else stacklevel + 1
    warnings.warn(opening(what, cause, fix, section, details), category, stacklevel=level)


def warn_error(error: BaseException, category: type, stacklevel: Optional[int] = None) -> None:
    """Warns `category` with the text of `error`, an error whose message `opening` built (e.g. a
    `NonFiniteError` a run reports instead of raising)."""
    level = user_stacklevel() if stacklevel is None else stacklevel + 1
    warnings.warn(str(error), category, stacklevel=level)


def invalid_argument(name: str, received: Any, expected: str, fix: str = "", choices: Iterable[str] = ()) -> ValueError:
    """Builds (not raises) a ValueError in the project's template: `expected` is a phrase, `fix` what to
    pass instead with an example; a string `received` close to one of `choices` gets "Did you mean ...?"."""
    if isinstance(received, str):
        fix = did_you_mean(received, choices) or fix
    return ValueError(_template(f"`{name}` argument", name, received, expected, fix))


def invalid_state(name: str, received: Any, expected: str, fix: str, where: str = "") -> ValueError:
    """Builds (not raises) a ValueError in the same template for a state value read, not passed:
    ``"Invalid `dynamic_scale` loaded into optimizer 'lso'. Expected ... Received: dynamic_scale=nan ..."``;
    `where` says where it came from (e.g. ``"loaded into optimizer 'lso'"``)."""
    return ValueError(_template(f"`{name}` {where}".rstrip(), name, received, expected, fix))


def _template(subject: str, name: str, received: Any, expected: str, fix: str) -> str:
    message = (
        f"Invalid {subject}. Expected {expected}. "
        f"Received: {name}={shown(received)} (of type {type(received).__name__})."
    )
    return f"{message} {fix}" if fix else message


#: Arrays and tensors with more elements than this are shown by shape and dtype.
SHOWN_ELEMENTS = 20


def shown(value: Any) -> str:
    """How a message shows `value`: its ``repr``, but an array or tensor of more than `SHOWN_ELEMENTS`
    elements (also in a tuple, list or dict) as ``array(shape=(60000, 784), dtype=float32)``."""
    dims = _dims(value)
    if dims is not None and math.prod(dims) > SHOWN_ELEMENTS:
        return f"array(shape={dims}, dtype={getattr(value.dtype, 'name', value.dtype)})"
    if isinstance(value, (tuple, list)) and any(hasattr(item, "shape") for item in value):
        items = ", ".join(shown(item) for item in value)
        return f"({items}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) else f"[{items}]"
    if isinstance(value, dict) and any(hasattr(item, "shape") for item in value.values()):
        return "{" + ", ".join(f"{key!r}: {shown(item)}" for key, item in value.items()) + "}"
    return repr(value)


def _dims(value: Any) -> Optional[tuple]:
    """The fully known shape of an array or tensor, as a tuple of ints; None for anything else."""
    shape = getattr(value, "shape", None)
    if shape is None or getattr(value, "dtype", None) is None:
        return None
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):  # an unknown dimension, or no shape at all
        return None


def did_you_mean(received: Any, choices: Iterable[str], cutoff: float = 0.5) -> str:
    """``"Did you mean 'x'?"`` for a choice differing only in case, else `difflib`'s closest above `cutoff`;
    ``""`` when nothing is close."""
    choices = list(choices)
    by_case = {choice.lower(): choice for choice in choices}
    if str(received).lower() in by_case:  # only the case differs
        return f"Did you mean {by_case[str(received).lower()]!r}?"
    close = difflib.get_close_matches(str(received), choices, n=1, cutoff=cutoff)
    return f"Did you mean {close[0]!r}?" if close else ""


def unknown_key(name: str, received: dict, key: Any, choices: Iterable[str]) -> ValueError:
    """The template ValueError for the dict argument `name` holding a `key` not among `choices`."""
    choices = list(choices)
    fix = unknown_fix(f"Unknown key {key!r}.", key, choices)
    return invalid_argument(name, received, "keys among " + ", ".join(choices), fix=fix)


def unknown_fix(unknown: str, key: Any, choices: Iterable[str]) -> str:
    """The fix for an unknown key or keyword: the sentence `unknown`, then a close choice or "remove it"."""
    return f"{unknown} {did_you_mean(key, choices, cutoff=0.6) or 'Remove it, or use one of those listed.'}"


def is_positive_int(value: Any) -> bool:
    """Bool. True for an int >= 1 (bools excluded)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive_int(name: str, value: Any, *, allow_none: bool = False, fix: str = "",
                       maximum: Optional[int] = None, why: str = "") -> None:
    """Raises ValueError (template) unless `value` is an int >= 1 and <= `maximum` (or None with `allow_none`).

    `maximum` is for a count that sizes an allocation, so a typo (``10**9``) is refused; `why` says why.
    """
    if allow_none and value is None:
        return
    if not is_positive_int(value) or (maximum is not None and value > maximum):
        expected = "an integer >= 1" + (f" and <= {maximum}" if maximum is not None else "")
        expected += (" or None" if allow_none else "") + (f" ({why})" if why else "")
        raise invalid_argument(name, value, expected, fix=fix)


def check_positive_number(name: str, value: Any, *, fix: str) -> None:
    """Raises ValueError (template) unless `value` is a finite int or float > 0 (a scale, a bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise invalid_argument(name, value, "a finite number > 0", fix=fix)


def check_bool(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raises ValueError (template) unless `value` is True or False (or None with `allow_none`)."""
    if not (isinstance(value, bool) or (allow_none and value is None)):
        if allow_none:
            raise invalid_argument(name, value, "None, True or False",
                                   fix=f"Pass {name}=True, {name}=False or {name}=None.")
        raise invalid_argument(name, value, "True or False",
                               fix=f"Pass {name}=True or {name}=False.")


def _package_dir(name: str) -> str:
    path = getattr(sys.modules.get(name), "__file__", None)
    return _normalized(os.path.dirname(path)) + os.sep if path else "\0"


def _normalized(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


def user_stacklevel() -> int:
    """The ``stacklevel`` for `warnings.warn` naming the user's line: from this function's caller (level 1)
    to the first frame outside tfmp, Keras, TensorFlow and `contextlib` (a `tfmp.policy_scope` body)."""
    libraries = tuple(_package_dir(name) for name in ("tfmp", "keras", "tensorflow")) + (
        _normalized(contextlib.__file__),)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and _normalized(frame.f_code.co_filename).startswith(libraries):
        frame, level = frame.f_back, level + 1
    return level


def check_type(name: str, value: Any, types: Any, expected: str, *, items: Any = None, allow_none: bool = False,
               fix: str = "") -> None:
    """Raises ValueError (template) unless `value` is one of `types` (a bool only if `bool` is listed)
    and, given `items`, each of its elements (a dict's values) one of `items`; `expected` is a phrase."""
    if allow_none and value is None:
        return
    types = types if isinstance(types, tuple) else (types,)
    accepted = isinstance(value, types) and (bool in types or not isinstance(value, bool))
    if accepted and items is not None:
        elements = value.values() if isinstance(value, dict) else value
        accepted = all(isinstance(element, items) for element in elements)
    if not accepted:
        raise invalid_argument(name, value, expected + (" or None" if allow_none else ""), fix=fix)


def check_model(name: str, model: Any, *, expected: str = "a keras.Model", fix: str = "") -> None:
    """Raises ValueError (template) unless `model` is a `keras.Model` with layers (an unbuilt subclassed
    one may make them in ``build``); `expected` and `fix` are for a value that is not a model."""
    import keras  # imported here: the rest of this module does without Keras

    if not isinstance(model, keras.Model):
        raise invalid_argument(name, model, expected, fix=fix)
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    could_be_lazy = not model.built and not isinstance(model, keras.Sequential)
    if not layers and not could_be_lazy:
        raise invalid_argument(
            name, model, "a keras.Model with at least one layer",
            fix="Add the model's layers first, e.g. keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]).",
        )


def model_fix(call: str) -> str:
    """The fix for a model argument that is not a model; `call` is the right call, e.g. ``"tfmp.audit(model)"``."""
    return (f"Pass the model itself, e.g. {call}; wrap a single layer first, e.g. "
            "keras.Sequential([keras.Input((4,)), layer]).")
