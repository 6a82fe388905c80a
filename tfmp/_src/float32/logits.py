"""The logits rule: an output layer whose output only feeds a from-logits cross-entropy.

A model output is float32 (the loss is computed in float32, every term of it).
Most output layers compute in float32 for that, as the whole layer: a
regression head's Dense rounded to bfloat16 returns 3000 in steps of 16, and a
probability rounded to 16 bits turns 0.9995 into 1.0. Logits are different:
the loss (``keras.losses.SparseCategoricalCrossentropy(from_logits=True)`` and
the other cross-entropies with ``from_logits=True``) converts them to float32
and computes the log-softmax there, so a 16-bit rounding of a logit moves the
loss by about the same relative 2**-8 (bfloat16) as any 16-bit activation; this
is what the Keras mixed-precision guide does (a 16-bit ``Dense`` for the logits,
then a float32 ``softmax``; https://keras.io/guides/mixed_precision/) and what
PyTorch's autocast does (``linear`` in 16 bits, ``cross_entropy`` in float32).
The logits layer is often the widest matmul of a model (a language model's
vocabulary projection: two thirds of the keras.io miniature GPT's matmul work),
so computing it in float32 costs most of mixed precision's speed there.

So a leaf output layer with a linear activation whose every output is matched,
in the ``loss`` given to ``compile``, by one of `CROSS_ENTROPY` with
``from_logits=True``, keeps its 16-bit policy and only its output is cast to
float32 (reason `LOGITS_CAST` in `tfmp.audit`). Everything else stays as
`tfmp._src.float32.registry.decide` says: a softmax or sigmoid head, a loss
given as a string or a function (which tfmp cannot read ``from_logits`` from),
a `tfmp.force_float32` call (no loss known) and a layer a keep rule selects
compute in float32.

A tied output embedding (`REVERSIBLE_EMBEDDING`, Keras's ``ReversibleEmbedding``,
which keras-hub's language models use) is one layer called twice: a lookup at the
input, ``embedding(ids)``, and a linear projection of the last hidden state onto
the same matrix, ``embedding(h, reverse=True)``: the logits. When that projection
is a model output with a from-logits cross-entropy, the layer keeps its 16-bit
policy and only the outputs of its projecting calls are cast to float32
(`reverse_call`); the lookup hands the 16-bit body its 16-bit vectors as under
plain Keras. Forced whole instead, its lookup and its projection run in float32
(``benchmarks/tied_logits.py``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Set

import keras

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
#: Keras's tied input/output embedding (Keras >= 3.13; None on an older Keras).
REVERSIBLE_EMBEDDING = getattr(keras.layers, "ReversibleEmbedding", None)


def projects(layer: Any) -> bool:
    """True for a `REVERSIBLE_EMBEDDING`: its ``reverse=True`` call is a linear projection."""
    return REVERSIBLE_EMBEDDING is not None and isinstance(layer, REVERSIBLE_EMBEDDING)


def reverse_call(args: tuple, kwargs: dict) -> bool:
    """True when ``ReversibleEmbedding.call(inputs, reverse=False)``'s arguments ask to project."""
    return bool(kwargs["reverse"] if "reverse" in kwargs else len(args) > 1 and args[1])


def linear_output(layer: Any, node_index: int = 0) -> bool:
    """True when `layer`'s call at `node_index` is linear: a linear leaf, or a projecting
    `REVERSIBLE_EMBEDDING` call (its Functional node's arguments)."""
    if projects(layer):
        node = inbound_node(layer, node_index)
        return reverse_call(tuple(node.arguments.args), dict(node.arguments.kwargs))
    return linear_leaf(layer)


def takes_logits(loss: Any) -> bool:
    """True for a `CROSS_ENTROPY` loss object built with ``from_logits=True``."""
    return isinstance(loss, CROSS_ENTROPY) and bool(loss.get_config().get("from_logits"))


def logits_layers(model: keras.Model, loss: Any) -> Set[int]:
    """Ids of the leaf layers of ``model`` whose outputs are all logits of ``loss``.

    Args:
        model: ``keras.Model`` with a graph (Functional, or Sequential built on an
            ``Input``); a model without one gives the empty set.
        loss: What ``compile`` receives: one loss for every output, a list (one
            per output, in order) or a dict (by output name); None gives the
            empty set.

    Returns:
        Set of ``id(layer)`` of layers that produce model outputs directly, have
        ``activation`` ``linear`` and no sublayers (or are a `REVERSIBLE_EMBEDDING`
        whose output calls project, `linear_output`), and each of whose outputs
        has a from-logits cross-entropy loss.
    """
    graph = functional_graph(model)
    if loss is None or graph is None:
        return set()
    per_output = _per_output(loss, list(getattr(model, "output_names", None) or []), len(graph.outputs))
    verdicts: Dict[keras.layers.Layer, List[bool]] = {}  # producer -> is each of its outputs linear logits
    for tensor, output_loss in zip(graph.outputs, per_output):
        history = keras_history(tensor)
        layer = None if history is None else history.operation
        if isinstance(layer, keras.layers.Layer) and not isinstance(layer, keras.Model):
            verdicts.setdefault(layer, []).append(
                takes_logits(output_loss) and linear_output(layer, history.node_index))
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
