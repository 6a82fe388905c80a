"""Exact token ids for an ``Embedding`` inside 16-bit custom code.

A custom layer or subclassed model around an ``Embedding`` casts float ids to its 16-bit
compute dtype, exact only up to 256 (bfloat16) or 2048 (float16). `keep_exact_ids` gives
each such ancestor a policy copy whose ``convert_input`` records the float original of each
tensor it casts down; the ``Embedding`` looks that original up when it receives the cast tensor.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Tuple

import keras

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import layer_calls
from tfmp._src.keras_hooks.functional_graph import functional_graph
from tfmp._src.keras_hooks.layer_calls import autocasts_inputs
from tfmp._src.layer_tree import walk

#: id of a 16-bit tensor an ancestor's autocast made -> (that tensor, the float tensor it came from).
_ORIGINALS: Dict[int, Tuple[Any, Any]] = {}
_OWNER = "float32.ids"


def _hooked(target: Any, name: str) -> bool:
    return layer_calls.subscribed(target, name, _OWNER)


def _record_casts(layer: Any) -> None:
    """Gives `layer` a private policy copy whose ``convert_input`` records originals."""
    policy = layer.dtype_policy
    own = type(policy)(policy.name)
    recorded: List[int] = []
    finished = [False]  # True once `call` returned: the next conversion starts a new call

    def forget() -> None:
        while recorded:
            _ORIGINALS.pop(recorded.pop(), None)

    def wrap_convert(convert):
        @functools.wraps(convert)
        def convert_input(x, autocast, dtype):
            if finished[0]:
                finished[0] = False
                forget()
            result = convert(x, autocast, dtype)
            if result is not x and keras.backend.standardize_dtype(result.dtype) in LOW_PRECISION:
                _ORIGINALS[id(result)] = (result, x)
                recorded.append(id(result))
            return result

        return convert_input

    def wrap_call(call):
        @functools.wraps(call)
        def mark_finished(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            finally:
                finished[0] = True

        return mark_finished

    layer_calls.subscribe(own, "convert_input", wrap_convert, owner=_OWNER)
    layer.dtype_policy = own
    layer_calls.subscribe(layer, "call", wrap_call, owner=_OWNER)


def _look_up_originals(embedding: Any) -> None:
    """Hooks `embedding.call` to use the pre-cast ids of a tensor an ancestor cast."""

    def wrap(call):
        @functools.wraps(call)
        def exact_ids(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            entry = _ORIGINALS.get(id(inputs))
            if entry is not None and entry[0] is inputs:
                inputs = entry[1]
            return call(inputs, *args, **kwargs)

        return exact_ids

    layer_calls.subscribe(embedding, "call", wrap, owner=_OWNER)


def _casting_ancestors(model: Any) -> Dict[int, Tuple[Any, List[Any]]]:
    """Embedding id -> (the Embedding, its ancestors that autocast floats to 16 bits)."""
    entries = walk(model)
    parent_of = {id(entry.layer): entry.parent for entry in entries}
    found: Dict[int, Tuple[Any, List[Any]]] = {}
    for entry in entries:
        if not isinstance(entry.layer, keras.layers.Embedding):
            continue
        ancestors, node = [], entry.parent
        while node is not None:
            if (
                autocasts_inputs(node)
                and functional_graph(node) is None
                and node.compute_dtype in LOW_PRECISION
                and node.dtype_policy.quantization_mode is None
            ):
                ancestors.append(node)
            node = parent_of.get(id(node))
        if ancestors:
            found[id(entry.layer)] = (entry.layer, ancestors)
    return found


def keep_exact_ids(model: keras.Model) -> int:
    """Makes every ``Embedding`` under 16-bit autocasting code look up the ids as given.

    Changes ``model`` in place, idempotently; returns the number of Embeddings newly hooked.
    """
    count = 0
    for embedding, ancestors in _casting_ancestors(model).values():
        for ancestor in ancestors:
            if not _hooked(ancestor, "call"):
                _record_casts(ancestor)
        if not _hooked(embedding, "call"):
            _look_up_originals(embedding)
            count += 1
    return count


def exact_id_embeddings(model: keras.Model) -> int:
    """Int. Embedding layers of `model` that look their ids up as given (hooked here)."""
    return sum(isinstance(e.layer, keras.layers.Embedding) and _hooked(e.layer, "call") for e in walk(model))
