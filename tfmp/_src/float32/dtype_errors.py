"""Dtype-mismatch errors that say which layer and what to do.

A layer mixing a tensor it creates (float32 by default) with its 16-bit inputs fails with
TensorFlow's terse text. `explain_dtype_errors` hooks a compiled model's ``build`` and
``call``: such an error is raised again, same type, with the failing layer's path, both
dtypes and the remedies. The backward pass: `tfmp._src.float32.gradient_errors`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple

import keras
import tensorflow as tf

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.errors import opening
from tfmp._src.keras_hooks import error_texts, layer_calls
from tfmp._src.layer_tree import walk

_MARK = "tfmp_dtype_hint"


def mismatched_dtypes(message: str) -> Optional[Tuple[str, str]]:
    """The (16-bit, wider) float dtypes a TensorFlow dtype-mismatch text names, e.g. ``("bfloat16", "float32")``."""
    pair = error_texts.mismatched_dtypes(message)
    if pair is None:
        return None
    low = [d for d in pair if d in LOW_PRECISION]
    wide = [d for d in pair if d not in LOW_PRECISION]
    return (low[0], wide[0]) if len(low) == 1 and len(wide) == 1 else None


def _failing_layer(model: Any, error: BaseException, message: str) -> Tuple[str, Any]:
    """(path, layer) of the layer whose code raised `error` inside `model`; ("", None) if unknown."""
    entries = walk(model)
    by_id = {id(entry.layer): entry.path for entry in entries}
    for owner in error_texts.call_frame_owners(error):
        if id(owner) in by_id:
            return by_id[id(owner)], owner
    name, cls = error_texts.layer_named_by_keras(message)
    for entry in entries:
        if name is not None and entry.layer.name == name:
            return entry.path, entry.layer
    matches = [entry for entry in entries if cls is not None and type(entry.layer).__name__ == cls]
    if len(matches) == 1:
        return matches[0].path, matches[0].layer
    return "", None


def explanation(path: str, layer: Any, low: str, wide: str, *, at_build: bool = False) -> str:
    """The text tfmp appends: the layer (``path`` "" when unknown), both dtypes and the remedies.

    Three lines and the guide's (`errors.opening`). With ``at_build`` (a model that has not built, so
    not compiled) only remedies that act before ``compile`` are offered: the layer's own ``dtype="float32"``,
    not ``keep_float32`` or ``register_float32``, which act at ``compile``.
    """
    cls = type(layer).__name__ if layer is not None else "its layer class"
    where = f"Layer '{path}' ({cls})" if path else "A layer of this model"
    target = repr(path) if path else "'<layer path>'"
    if at_build:
        in_float32 = f"create {cls if layer is not None else 'the layer'} with dtype=\"float32\""
    else:
        in_float32 = f"tfmp.enable(keep_float32=[{target}])"
    return "tfmp: " + opening(
        f"{where} mixes {low} and {wide} tensors; its inputs are {low}.",
        f"Its own code makes the {wide} one: a cast to {wide}, tf.constant, tf.ones, tf.random.*, a raw TF op.",
        f"Fix: make it with tf.cast(t, x.dtype) or dtype=self.compute_dtype; or {in_float32}.",
        "a-layer-mixes-16-bit-and-float32-tensors")


def _rebuilt(error: BaseException, text: str) -> Optional[BaseException]:
    """A new exception of `error`'s type whose text ends with `text`, or None."""
    if isinstance(error, tf.errors.OpError):
        new = type(error)(error.node_def, error.op, f"{error.message}\n\n{text}", error.error_code)
    else:
        try:
            new = type(error)(f"{error.args[0] if error.args else ''}\n\n{text}")
        except Exception:  # a constructor with another signature
            return None
    for key, value in vars(error).items():  # e.g. Keras's marker that it added its context
        if key not in vars(new):
            setattr(new, key, value)
    return new


def unexplained_mismatch(error: BaseException) -> Tuple[str, Optional[Tuple[str, str]]]:
    """(text, dtypes) of `error`: dtypes as `mismatched_dtypes`, None too once tfmp has `explained` it."""
    message = error.message if isinstance(error, tf.errors.OpError) else str(error)
    return message, (None if explained(error) else mismatched_dtypes(message))


def annotate(model: Any, error: BaseException) -> BaseException:
    """The exception to raise for `error` met in `model`: explained (`with_explanation`), or `error` itself."""
    message, dtypes = unexplained_mismatch(error)
    if dtypes is None:
        return error
    path, layer = _failing_layer(model, error, message)
    return with_explanation(error, explanation(path, layer, *dtypes))


def explained(error: BaseException) -> bool:
    """Bool. Whether tfmp already added its explanation to `error` (or built it)."""
    return bool(getattr(error, _MARK, False))


def with_explanation(error: BaseException, text: str) -> BaseException:
    """A new exception of `error`'s type, its text followed by `text`, chained to `error`, marked `explained`.

    When the type cannot be rebuilt, `error` itself with `text` as a note.
    """
    new = _rebuilt(error, text)
    if new is None:
        if hasattr(error, "add_note"):
            error.add_note(text)
        setattr(error, _MARK, True)
        return error
    setattr(new, _MARK, True)
    new.__cause__ = error
    return new.with_traceback(error.__traceback__)


def call_explained(annotate: Callable[[BaseException], BaseException], call: Callable, *args: Any,
                   **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``; what it raises is raised as `annotate` returns it (a new one chained to it)."""
    try:
        return call(*args, **kwargs)
    except Exception as error:
        new = annotate(error)
        if new is error:
            raise
        raise new from error


def _wrap(model: Any) -> Any:
    def wrap(original):
        return functools.wraps(original)(
            lambda *args, **kwargs: call_explained(lambda error: annotate(model, error), original, *args, **kwargs))

    return wrap


def explain_dtype_errors(model: keras.Model) -> None:
    """Hooks `model`'s ``build`` and ``call`` to explain dtype mismatches (idempotent)."""
    if layer_calls.subscribed(model, "call", "enable.dtype_errors"):
        return
    for name in ("build", "call"):
        layer_calls.subscribe(model, name, _wrap(model), owner="enable.dtype_errors")
