"""Dtype-mismatch errors while a Functional model is built, explained while enabled.

A layer mixing its 16-bit inputs with a float32 tensor it creates fails when called on
``keras.Input`` tensors, before ``compile`` and so before `dtype_errors`' hooks. `install`
hooks ``compute_output_spec``: in a thread with a session such an error is raised again,
same type, with the layer's path, both dtypes and the remedies that work before ``compile``.
A layer whose linalg op TensorFlow refuses in its 16-bit dtype is computed in float32 instead
(`unsafe_ops.force_at_build`), or, excluded, fails naming the op and the fix.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import keras

from tfmp._src.float32 import dtype_errors, registry, unsafe_ops
from tfmp._src.keras_hooks import error_texts, layer_calls
from tfmp._src.layer_tree import walk
from tfmp._src.policy import session


def _failing_layer(root: Any, error: BaseException) -> tuple:
    """(path, layer) of the layer whose ``call`` raised inside `root`'s symbolic call (paths start at its name)."""
    entries = [(root.name, root)] + [(entry.path, entry.layer) for entry in walk(root, root.name)]
    by_id = {id(layer): path for path, layer in entries}
    for owner in error_texts.call_frame_owners(error):
        if id(owner) in by_id:
            return by_id[id(owner)], owner
    return root.name, root


def annotate(layer: Any, error: BaseException) -> BaseException:
    """The exception to raise for `error` met inferring `layer`'s output: explained, or `error` itself.

    A Lambda's "could not infer the shape" error is explained by the mismatch Keras replaced with it.
    """
    cause = error_texts.swallowed_by_lambda(error) or error
    message, dtypes = dtype_errors.unexplained_mismatch(cause)
    if dtypes is None or "\n\ntfmp: " in message or dtype_errors.explained(error):
        return error
    path, failing = _failing_layer(layer, cause)
    return dtype_errors.with_explanation(
        error, dtype_errors.explanation(path, failing, *dtypes, at_build=True))


def _in_float32_if_refused(layer: Any, args: tuple, kwargs: dict, original: Callable) -> Any:
    """`original` on `layer`; again in float32 when TensorFlow refused its 16-bit linalg op (`unsafe_ops`).

    Exclusions are matched with the layer's name for its path (a Functional model's own layers).
    """
    try:
        return original(layer, *args, **kwargs)
    except (TypeError, ValueError) as error:
        state = session.current()
        if state is None:
            raise
        excluded = registry.is_excluded(layer, layer.name, state.exclude_float32)
        return unsafe_ops.force_at_build(layer, args, kwargs, error, functools.partial(original, layer),
                                         excluded)


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def tfmp_compute_output_spec(self: Any, *args: Any, **kwargs: Any) -> Any:
        return dtype_errors.call_explained(lambda error: error if session.current() is None else annotate(self, error),
                                           _in_float32_if_refused, self, args, kwargs, original)

    return tfmp_compute_output_spec


def install() -> layer_calls.Hook:
    """Hooks ``keras.layers.Layer.compute_output_spec``; remove the `Hook` to undo."""
    return layer_calls.subscribe(keras.layers.Layer, "compute_output_spec", _wrap,
                           owner="enable.build_errors")
