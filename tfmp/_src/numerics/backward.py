"""The backward pass seen at layer boundaries, for `tfmp.check_numerics(phase="backward" | "both")`.

The optimizer's gradients say which weights went non-finite, not which layer's backward
pass turned a finite gradient into NaN (a ``sqrt`` or a norm at 0, a custom gradient):
that layer's own weight gradients stay finite. So each checked layer call is bracketed
by identities with a custom gradient on each float input and output, which hand the
gradient back unchanged and note its largest magnitude in the step's trace; the report
names the layer whose output gradient was finite while its input or weight gradient was
not (`record.FailureRecorder`). Values and gradients are unchanged; a tensor no gradient
reaches notes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import tensorflow as tf

from tfmp._src.keras_hooks.layer_calls import carry_mask


@dataclasses.dataclass
class Boundary:
    """One checked layer call, as its backward pass is seen.

    Attributes:
        path: String. The layer's path.
        layer_class: String. Its class name.
        dtype: String. Its compute dtype.
        variables: Set of `id` of the layer's trainable weights (its sublayers' too).
        out_grads: List of scalar float32 tensors: max |dL/d(output)| per output
            tensor, noted while the gradient is computed.
        in_grads: List of scalar float32 tensors: max |dL/d(input)| per input.
        end: Int. Rank of the call among the step's checked calls by the time it
            returned (a block returns after its sublayers); -1 until then.
    """

    path: str
    layer_class: str
    dtype: str
    variables: set
    out_grads: list = dataclasses.field(default_factory=list)
    in_grads: list = dataclasses.field(default_factory=list)
    end: int = -1


def _magnitude(gradient: Any) -> tf.Tensor:
    if isinstance(gradient, tf.IndexedSlices):
        gradient = gradient.values
    return tf.cast(tf.reduce_max(tf.abs(tf.stop_gradient(gradient))), tf.float32)


def _probe(tensor: Any, sink: list, graph: Any) -> Any:
    """`tensor` through an identity whose gradient notes max |gradient| into `sink`.

    Only float `tf.Tensor`s are probed; anything else comes back as it is. A
    gradient built in another graph than `graph` (the step's) is passed on
    without a note: its tensor could not leave that graph.
    """
    if not isinstance(tensor, tf.Tensor) or not tensor.dtype.is_floating:
        return tensor

    @tf.custom_gradient
    def identity(x: tf.Tensor) -> Any:
        def gradient(upstream: Any) -> Any:
            if upstream is not None and tf.compat.v1.get_default_graph() is graph:
                sink.append(_magnitude(upstream))
            return upstream

        return tf.identity(x), gradient

    return carry_mask(tensor, identity(tensor))


def probe_structure(structure: Any, sink: list, graph: Any) -> Any:
    """Every float tensor of a nested `structure` probed (see `_probe`), the structure kept."""
    return tf.nest.map_structure(lambda value: _probe(value, sink, graph), structure)


def call_with_probes(
    original: Callable, args: tuple, kwargs: dict, first: Any, boundary: Boundary, graph: Any
) -> Any:
    """Runs a layer's `original` call with its first argument and its outputs probed.

    Args:
        original: The layer's ``call`` below the hook.
        args, kwargs: The call's arguments; the first (positional, or the
            keyword `first`) is the layer's input.
        first: String or None. The name of ``call``'s first parameter.
        boundary: `Boundary` of this call; its gradient lists fill during the
            backward pass.
        graph: The step's graph.

    Returns:
        The call's outputs, each float tensor through an identity.
    """
    if args:
        args = (probe_structure(args[0], boundary.in_grads, graph), *args[1:])
    elif first in kwargs:
        kwargs = {**kwargs, first: probe_structure(kwargs[first], boundary.in_grads, graph)}
    return probe_structure(original(*args, **kwargs), boundary.out_grads, graph)


def trainable_ids(layer: keras.layers.Layer) -> set:
    """`id` of each trainable weight of `layer` and of its sublayers."""
    return {id(variable) for variable in layer.trainable_weights}
