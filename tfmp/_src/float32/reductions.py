"""The wide float16 reduction rule: a layer whose own code sums float16 values past 65504.

TensorFlow's ``Sum`` and ``Mean`` return float16 for float16 inputs. Flagged, by tracing a
float16 layer's user code once on placeholders: a ``logsumexp`` or other sum/mean over
more than 65504 values (static sizes), and a sum of ``exp`` not shifted by its maximum
(`EXP_LIMIT`). Keras's own layers and subclassed models without a graph call are skipped.
"""

from __future__ import annotations

import dataclasses
import math
import re
import weakref
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from tfmp._src.constants import FLOAT16_MAX
from tfmp._src.keras_hooks.functional_graph import first_call_arguments
from tfmp._src.keras_hooks.layer_calls import child_layers
from tfmp._src.layer_tree import walk

#: ``ln 65504``: ``exp(x)`` is inf in float16 above it (IEEE 754 binary16).
EXP_LIMIT = math.log(FLOAT16_MAX)
#: The start of the reason `tfmp.audit` shows for a layer this rule forces.
REDUCTION = "float16 reduction"
_SUMS = ("Sum", "Mean")
#: Ops between ``max(x)`` and the ``x - max`` of TensorFlow's ``reduce_logsumexp``.
_PASS_THROUGH = ("StopGradient", "SelectV2", "Select", "Identity", "Cast")


@dataclasses.dataclass(frozen=True)
class WideReduction:
    """A float16 reduction in a layer's own code whose result can exceed 65504.

    Attributes:
        kind: String. ``"logsumexp"``, ``"sum of exp"``, ``"sum"`` or ``"mean"``.
        extent: Int. Number of values reduced into each result.
    """

    kind: str
    extent: int

    @property
    def reason(self) -> str:
        """The reason `tfmp.audit` shows, e.g. ``"float16 reduction: logsumexp over 76,800 values"``."""
        return f"{REDUCTION}: {self.kind} over {self.extent:,} values"

    def advice(self, path: str) -> str:
        """The cause and the fix, said for the layer at ``path``."""
        cause = (f"exp of a value above {EXP_LIMIT:.2f} is inf already" if self.kind == "sum of exp"
                 else f"summing {self.extent:,} values of magnitude 1 gives {self.extent:,}")
        return (f"its float16 {self.kind} over {self.extent:,} values can exceed {FLOAT16_MAX:g}, "
                f"the float16 maximum ({cause}). Compute it in float32: tfmp.force_float32(model) "
                f"(the layer not excluded) or tfmp.register_float32('{path}'), or cast its input "
                "to float32 before reducing.")


_FOUND: "weakref.WeakKeyDictionary[keras.layers.Layer, Optional[WideReduction]]" = (
    weakref.WeakKeyDictionary())


def wide_reduction(layer: keras.layers.Layer) -> Optional[WideReduction]:
    """The widest overflowing float16 reduction in ``layer``'s own code, or None.

    Traced once; a trace also decides for every sublayer, so ask for parents first.
    """
    if layer not in _FOUND:
        _analyze(layer)
    return _FOUND.get(layer)


def reason(layer: keras.layers.Layer) -> Optional[str]:
    """`WideReduction.reason` of ``layer``, or None."""
    found = wide_reduction(layer)
    return None if found is None else found.reason


def _runs_user_code(layer: keras.layers.Layer) -> bool:
    """True for a ``Lambda`` and for a layer whose ``call`` is not defined in Keras."""
    module = getattr(type(layer).call, "__module__", "") or ""
    return isinstance(layer, keras.layers.Lambda) or not module.startswith("keras.")


def _analyze(layer: keras.layers.Layer) -> None:
    """Traces ``layer`` and records the widest overflowing reduction of it and each sublayer."""
    if layer.compute_dtype != "float16" or not _runs_user_code(layer):
        return
    arguments = first_call_arguments(layer)
    graph = None if arguments is None else _trace(layer, *arguments)
    if graph is None:
        return
    for entry in walk(layer):
        _FOUND.setdefault(entry.layer, None)
    _FOUND[layer] = None
    for op in graph.get_operations():
        if op.type not in _SUMS or op.inputs[0].dtype != tf.float16:
            continue
        extent, kind = _extent(op), _kind(op)
        if kind == "sum of exp" or (extent is not None and extent > FLOAT16_MAX):
            owner, found = _owner(layer, op.name), WideReduction(kind, extent or 1)
            if _FOUND.get(owner) is None or _FOUND[owner].extent < found.extent:
                _FOUND[owner] = found


def _trace(layer: keras.layers.Layer, args: tuple, kwargs: dict) -> Optional[tf.Graph]:
    """The graph of ``layer(*args, **kwargs)`` on placeholders, or None (sparse input, or the trace failed)."""
    def spec(x: Any) -> Any:
        if isinstance(x, keras.KerasTensor):
            if x.sparse or x.ragged:
                raise TypeError("sparse input")
            return tf.TensorSpec(x.shape, x.dtype)
        return x

    try:
        args, kwargs = keras.tree.map_structure(spec, (tuple(args), dict(kwargs)))
        with keras.StatelessScope():
            function = tf.function(lambda *a, **k: layer(*a, **k), autograph=False)
            return function.get_concrete_function(*args, **kwargs).graph
    except Exception:  # any failure of user code: the layer is not checked
        return None


def _owner(layer: keras.layers.Layer, op_name: str) -> keras.layers.Layer:
    """The innermost layer whose ``__call__`` name scope (maybe suffixed ``_1``...) holds ``op_name``."""
    owner = layer
    for scope in op_name.split("/")[1:-1]:
        child = next((c for c in child_layers(owner)
                      if re.fullmatch(re.escape(c.name) + r"(?:_\d+)?", scope)), None)
        if child is None:
            break
        owner = child
    return owner


def _extent(op: tf.Operation) -> Optional[int]:
    """Values reduced into each result: the product of the reduced axes' known sizes."""
    axes = tf.get_static_value(op.inputs[1])
    shape = op.inputs[0].shape
    if axes is None or shape.rank is None:
        return None
    sizes = [shape[int(a) % shape.rank] for a in np.asarray(axes).ravel()]
    return math.prod(size for size in sizes if size is not None)


def _kind(op: tf.Operation) -> str:
    """``logsumexp`` (Sum of Exp of x - max), ``sum of exp``, ``sum`` or ``mean``."""
    source = op.inputs[0].op
    if source.type != "Exp":
        return op.type.lower()
    shifted = source.inputs[0].op
    if shifted.type == "Sub" and _from_max(shifted.inputs[1].op):
        return "logsumexp"
    return "sum of exp"


def _from_max(op: tf.Operation, depth: int = 4) -> bool:
    """True when ``op`` is a ``Max`` reduction, through a few pass-through ops."""
    if op.type == "Max":
        return True
    if depth == 0 or op.type not in _PASS_THROUGH:
        return False
    return any(_from_max(x.op, depth - 1) for x in op.inputs)
