"""The functional graph: the symbolic layers and tensors of a ``keras.Model(inputs, outputs)``, read and retyped.

No hook: private accessors for float32 forcing, `tfmp.audit` and the exact token ids.

| private name used | where in Keras | what tfmp does with it |
|---|---|---|
| ``Sequential._functional`` | ``keras/src/models/sequential.py`` | `functional_graph`: a built Sequential's inner graph |
| the class ``Functional`` (``keras.Model(inputs, outputs)``), not public | ``keras/src/models/functional.py`` | `is_functional`: a graph of layers that computes nothing itself (not a subclass) |
| ``Functional._nodes_by_depth`` | ``keras/src/ops/function.py`` | `nodes_by_depth`: the graph's nodes, to refresh symbolic dtypes |
| ``KerasTensor._keras_history`` | ``keras/src/backend/common/keras_tensor.py`` | `keras_history`: the operation that made a symbolic tensor |
| ``Operation._inbound_nodes`` | ``keras/src/ops/operation.py`` | `inbound_node`: the node of a raw op, to walk back to output layers; `first_call_arguments`: a layer's first call in a graph (``Node.arguments``) |
| ``KerasTensor._dtype`` | ``keras/src/backend/common/keras_tensor.py`` | `set_symbolic_dtype`: a forced layer's new output dtype in the graph |
"""

from __future__ import annotations

from typing import Any, Optional

import keras

from tfmp._src.keras_hooks import versions  # noqa: F401 (an unsupported pair fails at import)


def functional_graph(model: Any) -> Optional[Any]:
    """The Functional graph behind `model` (a built Sequential's private inner one), or None."""
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if hasattr(model, "_nodes_by_depth"):
        return model
    return None


def is_functional(layer: Any) -> bool:
    """Bool. `layer` is a plain ``keras.Model(inputs, outputs)`` (Keras's ``Functional``), no subclass."""
    from keras.src.models.functional import Functional

    return type(layer) is Functional


def nodes_by_depth(graph: Any) -> dict:
    """Dict from depth (int, 0 = outputs) to the list of `Node`s of a Functional graph."""
    return graph._nodes_by_depth


def keras_history(tensor: Any) -> Optional[Any]:
    """The `KerasHistory` (operation, node_index, tensor_index) of a symbolic tensor, or None."""
    return getattr(tensor, "_keras_history", None)


def inbound_node(operation: Any, node_index: int) -> Any:
    """The `Node` at `node_index` among the calls of `operation` (a layer or raw op)."""
    return operation._inbound_nodes[node_index]


def first_call_arguments(layer: Any) -> Optional[tuple]:
    """``(args, kwargs)`` (of `KerasTensor`s) of `layer`'s first call in a Functional graph, or None."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    if not nodes:
        return None
    return tuple(nodes[0].arguments.args), dict(nodes[0].arguments.kwargs)


def set_symbolic_dtype(tensor: Any, dtype: str) -> None:
    """Writes `dtype` into a `KerasTensor` in place: downstream nodes hold it by identity, and it has no setter."""
    tensor._dtype = dtype
