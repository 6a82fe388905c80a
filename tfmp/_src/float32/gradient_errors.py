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
from tfmp._src.float32 import dtype_errors
from tfmp._src.keras_hooks import error_texts, gradient_tape
from tfmp._src.layer_tree import walk

_OWNER = "enable.gradient_errors"


def explanation(path: str, layer: Any, low: str, wide: str, received: bool = False) -> str:
    """The text tfmp appends to a backward-pass mismatch: the layer, both dtypes, the fix.

    With `received`, the gradient reaching the layer is already `wide`, from a layer after it.
    """
    cls = type(layer).__name__ if layer is not None else "its layer class"
    where = f"layer '{path}' ({cls})" if path else "a layer of this model"
    target = repr(path) if path else "'<layer path>'"
    cast = ("cast such tensors to dy.dtype (ops.cast(self.kernel, dy.dtype)) and return "
            "each gradient in the dtype of its input (a variable's gradient in the "
            "variable's dtype)")
    if received:
        return (
            f"tfmp: The backward pass of {where} received a {wide} gradient for its {low} "
            f"output: a layer after it returns its gradient in the wrong dtype, typically "
            f"a gradient function (tf.custom_gradient) that reads a float32 variable "
            f"directly (self.kernel; tf.matmul of bfloat16 and float32 gives float32) or "
            f"creates a {wide} tensor. Fix: in that gradient function {cast}; or compute "
            f"that layer in float32: tfmp.enable(..., keep_float32=['<its path>']) or "
            f"tfmp.register_float32(<its class>) before compile.{_OUTPUT_GRADIENTS}"
        )
    return (
        f"tfmp: The backward pass of {where} mixes {low} and {wide} tensors: its "
        f"gradient function (tf.custom_gradient) receives the upstream gradient dy in "
        f"{low} (the layer's compute dtype), while a variable it reads directly "
        f"(self.kernel) or a tensor it creates (tf.constant, tf.ones, a raw TF op) "
        f"is {wide}. Fix: in the gradient function {cast}; or compute "
        f"the layer in float32: tfmp.enable(..., keep_float32=[{target}]) or "
        f"tfmp.register_float32({cls if layer is not None else target}) before compile."
        f"{_OUTPUT_GRADIENTS}"
    )


#: The other cause of both mismatches: an upstream gradient given in the wrong dtype.
_OUTPUT_GRADIENTS = (" If you pass output_gradients to tape.gradient, give each the dtype of the "
                     "output it belongs to (under tfmp a model's outputs are float32).")


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


def annotate(error: BaseException, sources: Any) -> BaseException:
    """The exception to raise for `error` out of ``tape.gradient(target, sources)``: explained, or `error`."""
    dtypes = dtype_errors.unexplained_mismatch(error)[1]
    found = None if dtypes is None else _failing_layer(error, sources)
    if found is None:
        return error
    path, layer, received = found
    return dtype_errors.with_explanation(error, explanation(path, layer, *dtypes, received=received))


def _wrap(gradient: Callable) -> Callable:
    @functools.wraps(gradient)
    def explained_gradient(self: Any, target: Any, sources: Any, *args: Any, **kwargs: Any) -> Any:
        return dtype_errors.call_explained(
            lambda error: annotate(error, sources), gradient, self, target, sources, *args, **kwargs)

    return explained_gradient


def install() -> gradient_tape.Hook:
    """Hooks ``tf.GradientTape.gradient`` to explain backward-pass dtype mismatches; returns the `Hook`."""
    return gradient_tape.subscribe(_wrap, owner=_OWNER)
