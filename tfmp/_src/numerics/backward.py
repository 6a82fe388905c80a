"""The backward pass seen at layer boundaries, for `tfmp.check_numerics(phase="backward" | "both")`.

A layer whose backward pass turns a finite gradient into NaN (``sqrt`` at 0, a custom
gradient) keeps finite weight gradients, so the optimizer's gradients cannot name it. Each
checked call is bracketed by identities whose gradient notes its largest magnitude; the
report names the call whose output gradient was finite while its input or weight one was not.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmp._src.keras_hooks.layer_calls import carry_mask


def keep_nan(values: tf.Tensor, reduced: tf.Tensor) -> tf.Tensor:
    """``reduced`` (a min or max of ``values``), NaN wherever ``values`` holds a NaN.

    TensorFlow's min/max kernels propagate NaN; XLA's CPU ones may drop it (under
    ``jit_compile=True`` a NaN input row read as finite), so the NaN is said explicitly.
    """
    if not values.dtype.is_floating:
        return reduced
    return tf.where(tf.reduce_any(tf.math.is_nan(values)), tf.cast(float("nan"), reduced.dtype), reduced)


def nan_max(values: tf.Tensor) -> tf.Tensor:
    """The max of ``values``, NaN if any is (`keep_nan`)."""
    return keep_nan(values, tf.reduce_max(values))


def max_magnitude(gradient: Any) -> tf.Tensor:
    """Float32 max |gradient| (of the values of `tf.IndexedSlices`), NaN if any is; no gradient through it."""
    if isinstance(gradient, tf.IndexedSlices):
        gradient = gradient.values
    return tf.cast(nan_max(tf.abs(tf.stop_gradient(gradient))), tf.float32)


@dataclasses.dataclass
class Boundary:
    """One checked layer call (path, class, compute dtype, `id`s of its trainable weights), as
    its backward pass is seen: max |gradient| per output and per input tensor, noted while the
    gradient is computed, and `end`, its rank among the step's checked calls by the time it
    returned (a block returns after its sublayers; -1 until then)."""

    path: str
    layer_class: str
    dtype: str
    variables: set
    out_grads: list = dataclasses.field(default_factory=list)
    in_grads: list = dataclasses.field(default_factory=list)
    end: int = -1


def _probe(tensor: Any, sink: list, graph: Any) -> Any:
    """A float `tensor` through an identity whose gradient notes max |gradient| into `sink`.

    A gradient built in another graph than `graph` (the step's) is passed on without a note.
    """
    if not isinstance(tensor, tf.Tensor) or not tensor.dtype.is_floating:
        return tensor

    @tf.custom_gradient
    def identity(x: tf.Tensor) -> Any:
        def gradient(upstream: Any) -> Any:
            if upstream is not None and tf.compat.v1.get_default_graph() is graph:
                sink.append(max_magnitude(upstream))
            return upstream

        return tf.identity(x), gradient

    return carry_mask(tensor, identity(tensor))


def _probe_structure(structure: Any, sink: list, graph: Any) -> Any:
    return tf.nest.map_structure(lambda value: _probe(value, sink, graph), structure)


def call_with_probes(original: Callable, args: tuple, kwargs: dict, first: Any, boundary: Boundary, graph: Any) -> Any:
    """Runs a layer's `original` call with its input (the first argument, or keyword `first`) and outputs probed.

    `boundary`'s gradient lists fill during the backward pass; `graph` is the step's.
    """
    if args:
        args = (_probe_structure(args[0], boundary.in_grads, graph), *args[1:])
    elif first in kwargs:
        kwargs = {**kwargs, first: _probe_structure(kwargs[first], boundary.in_grads, graph)}
    return _probe_structure(original(*args, **kwargs), boundary.out_grads, graph)


def trainable_ids(layer: keras.layers.Layer) -> set:
    """`id` of each trainable weight of `layer` and of its sublayers."""
    return {id(variable) for variable in layer.trainable_weights}
