"""The logits rule: an output layer whose output only feeds a from-logits cross-entropy.

A from-logits cross-entropy computes its log-softmax in float32 (Keras mixed-precision
guide), so a linear leaf output layer whose outputs all have one in ``compile``'s ``loss``
keeps its 16-bit policy, its output cast to float32 (`LOGITS_CAST`); a tied embedding
casts only its projecting calls. Measurements: benchmarks/README.md, "Where the time goes".
Where every loss of its outputs is a chunked cross-entropy (`tfmp.ChunkedSparseCategoricalCrossentropy`,
which computes in float32 chunk by chunk), its output stays 16-bit too (`LOGITS_16BIT`):
no float32 tensor of the logits' size. Measurements: benchmarks/README.md, "Decoder loss".
"""

from __future__ import annotations

from typing import Any, Dict, List, Set

import keras

from tfmp._src.float32.chunked_losses import _ChunkedLoss
from tfmp._src.keras_hooks.functional_graph import functional_graph, inbound_node, keras_history
from tfmp._src.keras_hooks.layer_calls import child_layers

#: Losses that compute in float32 from logits when built with ``from_logits=True``.
CROSS_ENTROPY = (
    keras.losses.SparseCategoricalCrossentropy,
    keras.losses.CategoricalCrossentropy,
    keras.losses.BinaryCrossentropy,
    keras.losses.CategoricalFocalCrossentropy,
    keras.losses.BinaryFocalCrossentropy,
)
#: Why a logits layer keeps its 16-bit policy and returns float32.
LOGITS_CAST = "logits cast to float32 (16-bit matmul, float32 cross-entropy)"
#: Why a logits layer whose outputs all feed a chunked cross-entropy keeps its 16-bit policy and output.
LOGITS_16BIT = "logits kept 16-bit (chunked float32 cross-entropy)"
#: Keras's tied input/output embedding (Keras >= 3.13; None on an older Keras).
REVERSIBLE_EMBEDDING = getattr(keras.layers, "ReversibleEmbedding", None)


def projects(layer: Any) -> bool:
    """True for a `REVERSIBLE_EMBEDDING`: its ``reverse=True`` call is a linear projection."""
    return REVERSIBLE_EMBEDDING is not None and isinstance(layer, REVERSIBLE_EMBEDDING)


def reverse_call(args: tuple, kwargs: dict) -> bool:
    """True when ``ReversibleEmbedding.call(inputs, reverse=False)``'s arguments ask to project."""
    return bool(kwargs["reverse"] if "reverse" in kwargs else len(args) > 1 and args[1])


def linear_output(layer: Any, node_index: int = 0) -> bool:
    """True when `layer`'s call at `node_index` is linear: a linear leaf or a projecting embedding."""
    if projects(layer):
        node = inbound_node(layer, node_index)
        return reverse_call(tuple(node.arguments.args), dict(node.arguments.kwargs))
    return linear_leaf(layer)


def takes_logits(loss: Any) -> bool:
    """True for a `CROSS_ENTROPY` loss object built with ``from_logits=True``."""
    return isinstance(loss, CROSS_ENTROPY) and bool(loss.get_config().get("from_logits"))


def chunked(loss: Any) -> bool:
    """True for a chunked cross-entropy (`tfmp.ChunkedSparseCategoricalCrossentropy` and its dense sibling)."""
    return isinstance(loss, _ChunkedLoss)


def logits_layers(model: keras.Model, loss: Any, accepts=None) -> Set[int]:
    """Ids of the `linear_output` layers producing outputs of ``model`` that all have a from-logits loss.

    ``loss`` is what ``compile`` receives (one, a list or a dict by output name); empty without a graph or loss.
    ``accepts`` (default: `takes_logits` or `chunked`) says which losses count.
    """
    accepts = accepts or (lambda one: takes_logits(one) or chunked(one))
    graph = functional_graph(model)
    if loss is None or graph is None:
        return set()
    per_output = _per_output(loss, list(getattr(model, "output_names", None) or []), len(graph.outputs))
    verdicts: Dict[keras.layers.Layer, List[bool]] = {}
    for tensor, output_loss in zip(graph.outputs, per_output):
        history = keras_history(tensor)
        layer = None if history is None else history.operation
        if isinstance(layer, keras.layers.Layer) and not isinstance(layer, keras.Model):
            verdicts.setdefault(layer, []).append(
                accepts(output_loss) and linear_output(layer, history.node_index))
    return {id(layer) for layer, logits in verdicts.items() if all(logits)}


def _per_output(loss: Any, names: List[str], count: int) -> List[Any]:
    """One loss per output, as Keras's ``compile`` reads ``loss``."""
    if isinstance(loss, dict):
        return [loss.get(name) for name in names] if len(names) == count else [None] * count
    if isinstance(loss, (list, tuple)):
        return list(loss) if len(loss) == count else [None] * count
    return [loss] * count


def linear_leaf(layer: keras.layers.Layer) -> bool:
    """True for a layer without sublayers whose activation is ``linear``."""
    name = getattr(getattr(layer, "activation", None), "__name__", None)
    return name == "linear" and not child_layers(layer)
