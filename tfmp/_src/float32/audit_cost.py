"""What float32 forcing costs a model, for `tfmp.audit`: the ``float32_heavy`` finding.

Forcing changes the dtype a layer's matmuls run in, so the cost is counted in
*multiplied parameters*: every weight but an ``Embedding`` table only looked up (a tied
projection counts its table once). The finding names the largest forced layers, their
multiplied parameters and the change that computes each in 16 bits.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import keras

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.float32 import logits as _logits
from tfmp._src.keras_hooks.layer_calls import child_layers
from tfmp._src.layer_tree import is_wiring, own_weights

#: More than this share of multiplied parameters in forced layers is ``float32_heavy``.
FLOAT32_HEAVY_FRACTION = 0.5
#: How many forced layers the finding names, largest first.
NAMED_LAYERS = 3
#: Why an unforced tied embedding's projection counts as float32 compute.
KERAS_PROJECTION = "tied projection in float32 (Keras: table not autocast)"


def float32_projection(layer: keras.layers.Layer) -> bool:
    """True for a tied embedding whose ``reverse=True`` matmul runs in float32 inside a model."""
    return _logits.projects(layer) and getattr(layer, "reverse_dtype", None) not in LOW_PRECISION


def _size(variable) -> int:
    return math.prod(int(dim) for dim in variable.shape)


def multiplied_params(layer: keras.layers.Layer, weights: Sequence, projecting: bool) -> int:
    """Parameters each example multiplies in ``layer``'s own ``weights`` (an ``Embedding``: its
    projection matrix when ``projecting`` with ``reverse=True``, else 0 for a lookup)."""
    if not isinstance(layer, keras.layers.Embedding):
        return sum(_size(w) for w in weights)
    if not projecting:
        return 0
    matrix = getattr(layer, "embeddings" if getattr(layer, "tie_weights", True) else "reverse_embeddings", None)
    return _size(matrix) if matrix is not None else 0


def borrowed_tables(layer: keras.layers.Layer, parents: Dict[int, object]) -> int:
    """Size of the ``Embedding`` tables ``layer`` holds as sublayers walked under another of ``parents``."""
    if is_wiring(layer):
        return 0
    return sum(_size(child.embeddings) for child in child_layers(layer)
               if isinstance(child, keras.layers.Embedding) and not _logits.projects(child)
               and parents.get(id(child), layer) is not layer and getattr(child, "embeddings", None) is not None)


def _change(path: str, layer, reason: str, policy: str) -> str:
    """What the user can change so that the forced layer at ``path`` computes in 16 bits."""
    low = policy.split("_", 1)[-1]
    exclude = (f"tfmp.enable('{policy}', exclude_float32=['{path}']) before compiling, or "
               f"tfmp.force_float32(model, exclude=['{path}'])")
    enabled = "while tfmp is enabled, without calling tfmp.force_float32 first"
    from_logits = ("compile the model with a cross-entropy loss object built with from_logits=True (e.g. "
                   f"loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)) {enabled}")
    kept = f"tfmp then keeps its matmul in {low} and casts the logits to float32"
    if _logits.projects(layer):
        return (f"set reverse_dtype='{low}' on it (layer.reverse_dtype = '{low}' before compiling, or "
                f"keras.layers.ReversibleEmbedding(..., reverse_dtype='{low}')) and {from_logits}: the matmul "
                f"then runs in {low} and tfmp casts the logits to float32")
    if reason == "output" and _logits.linear_leaf(layer):
        return f"if it produces logits, {from_logits}: {kept}"
    activation = getattr(getattr(layer, "activation", None), "__name__", "")
    if reason == "output" and activation in ("softmax", "sigmoid"):
        loss = ("SparseCategoricalCrossentropy(from_logits=True) (or CategoricalCrossentropy)"
                if activation == "softmax" else "BinaryCrossentropy(from_logits=True)")
        return (f"its {activation} can move into the loss: build it with activation=None and compile with "
                f"loss=keras.losses.{loss} {enabled}: {kept} (apply keras.activations.{activation} to the "
                f"predictions where probabilities are needed); or, rounding its output to 16 bits: {exclude}")
    if reason == "output":
        return (f"it produces a model output, so its result is not rounded to 16 bits; to compute it in "
                f"{low} anyway: {exclude}")
    if reason == "user rule":
        return (f"a keep rule selected it: remove the class or pattern matching '{path}' from keep_float32= "
                "(tfmp.enable), keep= (tfmp.force_float32) or tfmp.register_float32 "
                "(tfmp.unregister_float32)")
    if reason.startswith("fused "):
        activation = reason[len("fused "):]
        return (f"only its fused {activation} needs float32: build it with activation=None followed by "
                f"keras.layers.Activation('{activation}'), and tfmp forces only the activation")
    return f"forced for its numerics ({reason}); to compute it in {low} at that risk: {exclude}"


def _cost(layer, params: int) -> str:
    if _logits.projects(layer):
        return (f"its output projection (reverse=True) is a float32 matmul, {params:,} multiply-adds "
                "per token (its lookup is a gather), forced or not: Keras's Embedding does not autocast "
                "its table inside a model, so the 16-bit hidden state is promoted to float32")
    return f"its {params:,} parameters are multiplied in float32 at every position it is applied to"


def float32_heavy(
    forced: Sequence[Tuple[str, keras.layers.Layer, str, int]],
    layers: Dict[str, keras.layers.Layer],
    total: int,
    fraction: float,
    policy: str,
) -> Optional[str]:
    """The ``float32_heavy`` message naming the largest forced roots, or None (at most half the cost, not mixed).

    ``forced``: ``(path, layer, reason, multiplied parameters)`` of each layer computing in float32.
    """
    if fraction <= FLOAT32_HEAVY_FRACTION or not policy.startswith("mixed"):
        return None
    per_root: Dict[str, int] = {}
    for path, _, reason, params in forced:
        key = reason[len("inside "):] if reason.startswith("inside ") else path  # the forced layer it sits in
        per_root[key] = per_root.get(key, 0) + params
    reasons = {path: reason for path, _, reason, _ in forced}
    named: List[str] = []
    for path, params in sorted(per_root.items(), key=lambda item: -item[1])[:NAMED_LAYERS]:
        layer, reason = layers[path], reasons.get(path, "")
        if not params:
            break
        own = sum(_size(w) for w in own_weights(layer))
        of = f" of its {own:,}" if own > params else " of the Embedding it holds" if own < params else ""
        named.append(f"'{path}' ({type(layer).__name__}, {params:,} parameters{of}, {params / total:.0%}; "
                     f"float32: {reason}): {_cost(layer, params)}. To change it: "
                     f"{_change(path, layer, reason, policy)}.")
    return (f"{fraction:.0%} of the parameters the model multiplies per example (embedding lookups not "
            f"counted) are multiplied in float32, so mixed precision speeds up little. "
            + " ".join(named))

