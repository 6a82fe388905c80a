"""Dtype-mismatch errors of the backward pass that say which layer and what to do.

A ``tf.custom_gradient`` mixing a float32 tensor with the 16-bit upstream gradient fails
in ``tape.gradient``, outside the ``call`` `dtype_errors` watches. `install` hooks
``tf.GradientTape.gradient``: for a model attached with ``explains_dtype_errors`` such an
error is raised again, same type, with the layer's path, both dtypes and the fix.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Iterator, List, Optional, Tuple

import keras
import tensorflow as tf

from tfmp._src.attachment import record
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.errors import opening
from tfmp._src.float32 import dtype_errors
from tfmp._src.keras_hooks import error_texts, gradient_tape
from tfmp._src.layer_tree import walk

_OWNER = "enable.gradient_errors"


def explanation(path: str, layer: Any, low: str, wide: str, received: bool = False,
                output_gradient: Optional[Tuple[str, str]] = None) -> str:
    """The text tfmp appends to a backward-pass mismatch: the layer, both dtypes, the fix (`errors.opening`).

    With `received`, the gradient reaching the layer is already `wide`, from a layer after it. With
    `output_gradient` ``(given, output)``, the ``output_gradients`` passed to ``tape.gradient`` were
    `given` for a `output` output: that is the cause named.
    """
    cls = type(layer).__name__ if layer is not None else "its layer class"
    where = f"layer '{path}' ({cls})" if path else "a layer of this model"
    target = repr(path) if path else "'<layer path>'"
    if received:
        what = f"The backward pass of {where} received a {wide} gradient for its {low} output."
        cause = ("A layer after it returns its gradient in the wrong dtype, e.g. its tf.custom_gradient "
                 "reads self.kernel.")
        fix = "Fix: in that gradient function use ops.cast(self.kernel, dy.dtype); or keep_float32=['<its path>']."
    else:
        what = f"The backward pass of {where} mixes {low} and {wide} tensors; dy is {low}."
        cause = (f"Its tf.custom_gradient reads a {wide} variable (self.kernel) or makes a {wide} tensor "
                 "(tf.constant, tf.ones).")
        fix = (f"Fix: ops.cast(self.kernel, dy.dtype), return gradients in their inputs' dtypes; "
               f"or keep_float32=[{target}].")
    if output_gradient is not None:
        given, output = output_gradient
        cause = f"The output_gradients given to tape.gradient are {given} for a {output} output."
        fix = "Fix: give each output gradient the dtype of the output it belongs to (float32 under tfmp)."
    return "tfmp: " + opening(what, cause, fix, "a-gradient-function-mixes-16-bit-and-float32-tensors")


def _wrong_output_gradient(target: Any, output_gradients: Any) -> Optional[Tuple[str, str]]:
    """(given, output) dtypes of the first of `output_gradients` whose dtype is not its `target`'s; else None."""
    if output_gradients is None:
        return None
    for output, given in zip(tf.nest.flatten(target), tf.nest.flatten(output_gradients)):
        try:
            wanted, got = tf.as_dtype(output.dtype), tf.as_dtype(given.dtype)
        except (AttributeError, TypeError):  # None, or not a tensor: nothing to compare
            continue
        if wanted != got:
            return got.name, wanted.name
    return None


def _explaining_models() -> List[Any]:
    """Live attached models whose dtype errors tfmp explains, outermost first."""
    models = [obj for obj in record.marked_objects() if isinstance(obj, keras.Model)
              and getattr(record.of(obj), "explains_dtype_errors", False)]
    return sorted(models, key=lambda m: -len(walk(m)))


def _held_layers(frames: List[Any]) -> Iterator[Any]:
    """Each layer a frame holds (``self`` first, then its other locals and free variables)."""
    for frame in frames:
        values = dict(frame.f_locals)
        for value in [values.pop("self", None), *values.values()]:
            if isinstance(value, keras.layers.Layer):
                yield value


def _path_in(model: Any, layer: Any) -> Optional[str]:
    if layer is model:
        return ""
    return next((entry.path for entry in walk(model) if entry.layer is layer), None)


def _by_sources(models: List[Any], sources: Any) -> Optional[Any]:
    """The model among `models` whose trainable variables include one of the tape's sources."""
    ids = {id(s) for s in tf.nest.flatten(sources)}
    for model in models:
        if any(id(v) in ids or id(getattr(v, "value", None)) in ids for v in model.trainable_variables):
            return model
    return None


def _by_defining_class(model: Any, frames: List[Any]) -> Tuple[str, Any]:
    """(path, layer): the one layer of `model` of the class a failing frame's function was defined in."""
    entries = walk(model)
    for frame in frames:
        cls = getattr(frame.f_code, "co_qualname", frame.f_code.co_name).split(".")[0]
        matches = [e for e in entries if type(e.layer).__name__ == cls]
        if len(matches) == 1:
            return matches[0].path, matches[0].layer
        if type(model).__name__ == cls:
            return "", model
    return "", None


def _by_scope(model: Any, scope: str) -> Tuple[str, Any]:
    """(path, layer) of the deepest layer of `model` whose Keras name scope `scope` is in.

    `scope` starts with the model's scope; TensorFlow may suffix each part ``_1``.
    """
    parts = scope.split("/")[1:]
    best: Tuple[int, int, str, Any] = (0, 0, "", None)
    for entry in walk(model):
        names = entry.path.split("/")
        if len(names) > len(parts):
            continue
        exact = sum(a == b for a, b in zip(names, parts))
        if all(a == b or re.fullmatch(re.escape(a) + r"_\d+", b) for a, b in zip(names, parts)):
            best = max(best, (len(names), exact, entry.path, entry.layer), key=lambda t: t[:2])
    return best[2], best[3]


def _failing_layer(error: BaseException, sources: Any) -> Optional[Tuple[str, Any, bool]]:
    """(path, layer, received) for the layer whose backward pass raised `error`.

    From a traceback frame holding a layer, else the failing function's class, else
    the op's name scope; path ``""`` when only the model is known, None when no
    explaining model is concerned. `received`: a layer after it fed a wider gradient.
    """
    models = _explaining_models()
    if not models:
        return None
    frames = error_texts.frames_innermost_first(error)
    for layer in _held_layers(frames):
        for model in models:
            path = _path_in(model, layer)
            if path is not None:
                return path, (layer if path else None), False
    model = _by_sources(models, sources)
    if model is None:
        return None
    path, layer = _by_defining_class(model, frames)
    if path:
        return path, layer, False
    for scope, grads in error_texts.gradient_frames(error):
        path, layer = _by_scope(model, scope)
        return path, (layer if path else None), any(g not in LOW_PRECISION for g in grads)
    return "", None, False


def annotate(error: BaseException, sources: Any, target: Any = None, output_gradients: Any = None) -> BaseException:
    """The exception to raise for `error` out of ``tape.gradient(target, sources, output_gradients)``:
    explained, or `error`."""
    dtypes = dtype_errors.unexplained_mismatch(error)[1]
    found = None if dtypes is None else _failing_layer(error, sources)
    if found is None:
        return error
    path, layer, received = found
    wrong = _wrong_output_gradient(target, output_gradients)
    return dtype_errors.with_explanation(
        error, explanation(path, layer, *dtypes, received=received, output_gradient=wrong))


def _wrap(gradient: Callable) -> Callable:
    @functools.wraps(gradient)
    def explained_gradient(self: Any, target: Any, sources: Any, *args: Any, **kwargs: Any) -> Any:
        given = kwargs.get("output_gradients", args[0] if args else None)
        return dtype_errors.call_explained(
            lambda error: annotate(error, sources, target, given), gradient, self, target, sources, *args, **kwargs)

    return explained_gradient


def install() -> gradient_tape.Hook:
    """Hooks ``tf.GradientTape.gradient`` to explain backward-pass dtype mismatches; returns the `Hook`."""
    return gradient_tape.subscribe(_wrap, owner=_OWNER)
