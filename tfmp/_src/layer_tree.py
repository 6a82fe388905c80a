"""One walk of a model's layer tree and one layer-path convention for all of tfmp.

A layer's path joins layer names with ``/`` from the model down, without the model's
name (``"encoder/block_1/dense"``), so a path printed by one tfmp call can be passed to
another. Keras's ``layer.path`` depends on the name scope a layer was created in.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional

import keras

from tfmp._src.keras_hooks.functional_graph import is_functional
from tfmp._src.keras_hooks.layer_calls import child_layers


class LayerEntry(NamedTuple):
    """One layer of a walk: its `path`, the `layer` and its `parent` (None for none)."""

    path: str
    layer: Any
    parent: Optional[Any]


def walk(root: Any, prefix: str = "") -> List[LayerEntry]:
    """Lists every layer under `root` (not itself, path `prefix`) once, parents first.

    `keras.layers.InputLayer`s are skipped; a layer shared by two parents is
    listed once, under the first.
    """
    entries: List[LayerEntry] = []
    seen = set()

    def visit(parent: Any, path: str) -> None:
        for child in child_layers(parent):
            if id(child) in seen or isinstance(child, keras.layers.InputLayer):
                continue
            seen.add(id(child))
            child_path = f"{path}/{child.name}" if path else child.name
            entries.append(LayerEntry(child_path, child, parent))
            visit(child, child_path)

    visit(root, prefix)
    return entries


def own_weights(layer: Any) -> list:
    """The weights `layer` holds itself, not through a sublayer."""
    inner = {id(w) for entry in walk(layer) for w in entry.layer.weights}
    return [w for w in layer.weights if id(w) not in inner]


def is_wiring(layer: Any) -> bool:
    """Bool. Input layers and Functional/Sequential containers compute nothing themselves."""
    return isinstance(layer, (keras.layers.InputLayer, keras.Sequential)) or is_functional(layer)


def layers_compute_dtype(model: Any, entries: Optional[List[LayerEntry]] = None) -> str:
    """What `model`'s layers compute in: ``"float16"`` where any layer computes in float16 (its gradients
    need loss scaling, its kernels tfmp's float16 paths), else ``"bfloat16"`` where any does, else the
    model's own compute dtype.

    The layers', not the model's: Keras gives a model loaded under another session's policy, and its
    inputs, that policy, while its layers keep the ones saved with them. `entries`: `walk(model)`, if made.
    """
    dtypes = {entry.layer.compute_dtype for entry in (walk(model) if entries is None else entries)}
    return next((dtype for dtype in ("float16", "bfloat16") if dtype in dtypes), model.dtype_policy.compute_dtype)
