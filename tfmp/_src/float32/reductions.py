"""The wide 16-bit reduction rule: a layer whose own code sums, accumulates, ranks or counts
past what its 16-bit dtype holds.

Flagged, by tracing a 16-bit layer's user code once on placeholders:

- float16 ``Sum`` / ``Mean`` (TensorFlow returns float16): a ``logsumexp`` or other sum/mean
  over more than 65504 values (static sizes), and a sum of ``exp`` not shifted by its
  maximum (`EXP_LIMIT`);
- a running sum or product (``Cumsum``, ``Cumprod``, ``SegmentSum``, ``UnsortedSegmentSum``
  and the like, `_ACCUMULATIONS`) over more values than the dtype counts exactly
  (`EXACT_INTEGER_LIMIT`: bfloat16 256, float16 2,048) or over an unknown number: it stalls;
- a ``TopKV2`` over 16-bit values: near-ties round together and pick other entries. The
  layer owning it is forced (its input, the ranked values and the gates in float32, its
  output handed back in 16 bits); when the ranked values come from some of its direct
  sublayers (a MoE router), only those follow it into float32 (`inherits`): the others
  (the experts) keep the 16-bit policy;
- positions past the exact integer range: a 16-bit ``Range``, or an int ``Range`` cast to
  16 bits (a RoPE's ``arange(seq_len, dtype=self.compute_dtype)``). Int ranges are not flagged;
- a 16-bit uniform random draw compared with a threshold (a hand-written dropout mask,
  ``keras.random.uniform(..., dtype=self.compute_dtype) < rate``): the draw comes in steps
  of 1/128 (bfloat16) or 1/1024 (float16), so the rate rounds to a whole step (a rate of
  0.002 drops 3.9x its rate in bfloat16). Keras's own dropout is `dropout_draw.py`'s.

Keras's own layers and subclassed models without a graph call are skipped.
"""

from __future__ import annotations

import dataclasses
import math
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfmp._src.constants import EXACT_INTEGER_LIMIT, FLOAT16_MAX, LOW_PRECISION
from tfmp._src.keras_hooks.functional_graph import first_call_arguments
from tfmp._src.keras_hooks.layer_calls import child_layers
from tfmp._src.layer_tree import walk

#: ``ln 65504``: ``exp(x)`` is inf in float16 above it (IEEE 754 binary16).
EXP_LIMIT = math.log(FLOAT16_MAX)
#: The start of the reason `tfmp.audit` shows for a float16 sum this rule forces.
REDUCTION = "float16 reduction"
_SUMS = ("Sum", "Mean")
#: Running sums and products: each output is an accumulation of up to `extent` inputs.
_ACCUMULATIONS = (
    "Cumsum", "Cumprod", "CumulativeLogsumexp", "SegmentSum", "SegmentSumV2", "SegmentMean",
    "SegmentProd", "SegmentProdV2", "UnsortedSegmentSum", "UnsortedSegmentProd", "SparseSegmentSum",
    "SparseSegmentSumWithNumSegments", "SparseSegmentMean", "SparseSegmentMeanWithNumSegments",
    "SparseSegmentSqrtN", "SparseSegmentSqrtNWithNumSegments",
)
#: Ops between ``max(x)`` and the ``x - max`` of TensorFlow's ``reduce_logsumexp``.
_PASS_THROUGH = ("StopGradient", "SelectV2", "Select", "Identity", "Cast")
#: Ops between a sublayer's output and the ``top_k`` ranking it, keeping its order.
_ORDER_KEEPING = ("Identity", "Softmax", "LogSoftmax", "Sigmoid", "Tanh", "Reshape", "ExpandDims", "Squeeze")
#: Ops between an int ``Range`` and its cast to 16 bits, moving values without changing them.
_INDEX_MOVES = ("Identity", "Reshape", "ExpandDims", "Squeeze", "StridedSlice", "Tile", "BroadcastTo", "Cast")
#: Uniform random draws, and what may stand between one and its comparison with a threshold.
_UNIFORM_DRAWS = ("RandomUniform", "StatelessRandomUniform", "StatelessRandomUniformV2")
_COMPARISONS = ("Less", "LessEqual", "Greater", "GreaterEqual")
_DRAW_MOVES = ("Identity", "Mul", "AddV2", "Add", "Sub", "Reshape", "ExpandDims")
#: Significant bits of each 16-bit dtype, as `EXACT_INTEGER_LIMIT` counts them.
_BITS = {dtype: int(math.log2(limit)) for dtype, limit in EXACT_INTEGER_LIMIT.items()}


@dataclasses.dataclass(frozen=True)
class WideReduction:
    """A 16-bit sum, accumulation, ranking or position range in a layer's own code that 16 bits get wrong.

    Attributes:
        kind: String. ``"logsumexp"``, ``"sum of exp"``, ``"sum"``, ``"mean"``; an accumulation
            op's name (``"cumsum"``, ``"segment_sum"``, ``"unsorted_segment_sum"``...);
            ``"top_k"``; ``"range"`` (positions); ``"uniform draw"`` (compared with a threshold).
        extent: Int or None (unknown). Values reduced into each result, accumulated, or
            ranked; for ``"range"``, the largest position.
        dtype: String. ``"float16"`` or ``"bfloat16"``, the op's dtype.
        made_by: Tuple of strings. For a ``"top_k"``: the names of the direct sublayers making
            the ranked values, the only ones forced with the layer; empty: all are.
    """

    kind: str
    extent: Optional[int]
    dtype: str = "float16"
    made_by: Tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """The reason `tfmp.audit` shows, e.g. ``"float16 reduction: logsumexp over 76,800 values"``,
        ``"bfloat16 positions: range up to 2,047"``, ``"bfloat16 ranking: top_k over 8 values made by
        'router'"``."""
        if self.kind == "range":
            return f"{self.dtype} positions: range up to " + (
                "an unknown length" if self.extent is None else f"{self.extent:,}")
        if self.kind == "uniform draw":
            return f"{self.dtype} random draw: uniform in steps of 1/{self._steps:,} compared with a threshold"
        category = "ranking" if self.kind == "top_k" else "reduction"
        made_by = ", ".join(f"'{name}'" for name in self.made_by)
        text = f"{self.dtype} {category}: {self.kind} over {self._count}"
        return f"{text} made by {made_by}" if made_by else text

    @property
    def _steps(self) -> int:
        """Values of a 16-bit uniform draw in [1, 2) (TensorFlow fills the significand): 2**(bits - 1)."""
        return 2 ** (_BITS[self.dtype] - 1)

    @property
    def _count(self) -> str:
        return "an unknown number of values" if self.extent is None else f"{self.extent:,} values"

    def advice(self, path: str) -> str:
        """The cause and the fix, said for the layer at ``path``."""
        exact = f"{self.dtype} holds whole numbers exactly only up to {EXACT_INTEGER_LIMIT.get(self.dtype, 0):,}"
        if self.kind in ("logsumexp", "sum of exp", "sum", "mean"):
            cause = (f"exp of a value above {EXP_LIMIT:.2f} is inf already" if self.kind == "sum of exp"
                     else f"summing {self._count} of magnitude 1 gives {self.extent:,}")
            problem = (f"its float16 {self.kind} over {self._count} can exceed {FLOAT16_MAX:g}, "
                       f"the float16 maximum ({cause})")
            local_fix = "cast its input to float32 before reducing"
        elif self.kind == "range":
            largest = "an unknown length" if self.extent is None else f"{self.extent:,}"
            problem = f"its {self.dtype} positions up to {largest} round together ({exact})"
            local_fix = "make the positions in float32 (keras.ops.arange(n, dtype='float32'))"
        elif self.kind == "uniform draw":
            problem = (f"its {self.dtype} uniform draw comes in steps of 1/{self._steps:,}: compared with a "
                       "threshold (a dropout rate), the threshold counts as the next whole step (measured: "
                       "a rate of 0.002 dropped 3.9x its rate in bfloat16, 1.5x in float16)")
            local_fix = ("draw in float32: keras.random.uniform(..., dtype='float32'), or "
                         "keras.random.dropout, which drops its rate under tfmp")
        elif self.kind == "top_k":
            problem = (f"its top_k over {self._count} ranks values rounded to {_BITS[self.dtype]} significant "
                       "bits: near-ties become ties and top_k picks other entries than float32 does")
            local_fix = "cast the values to float32 before ranking"
        else:
            problem = (f"its {self.dtype} {self.kind} over {self._count} stalls ({exact}: a running sum "
                       "of values of magnitude 1 stops growing there)")
            local_fix = "cast its input to float32 before accumulating"
        return (f"{problem}. Compute it in float32: tfmp.force_float32(model) (the layer not excluded) "
                f"or tfmp.register_float32('{path}'), or {local_fix}.")


_FOUND: "weakref.WeakKeyDictionary[keras.layers.Layer, Optional[WideReduction]]" = (
    weakref.WeakKeyDictionary())
#: Other rules reading the same trace, ``scan(layer, arguments, graph)`` (`unsafe_ops`): one trace per layer.
SCANNERS: List[Callable[[keras.layers.Layer, tuple, tf.Graph], None]] = []


def wide_reduction(layer: keras.layers.Layer) -> Optional[WideReduction]:
    """The widest 16-bit reduction, accumulation, ranking or range ``layer``'s own code gets wrong, or None.

    Traced once; a trace also decides for every sublayer, so ask for parents first.
    """
    analyze(layer)
    return _FOUND.get(layer)


def reason(layer: keras.layers.Layer) -> Optional[str]:
    """`WideReduction.reason` of ``layer``, or None."""
    found = wide_reduction(layer)
    return None if found is None else found.reason


def _runs_user_code(layer: keras.layers.Layer) -> bool:
    """True for a ``Lambda`` and for a layer whose ``call`` is not defined in Keras."""
    module = getattr(type(layer).call, "__module__", "") or ""
    return isinstance(layer, keras.layers.Lambda) or not module.startswith("keras.")


def inherits(parent: keras.layers.Layer, child: keras.layers.Layer) -> bool:
    """False when ``parent`` is forced for a ``top_k`` whose values ``child`` does not make (an expert)."""
    found = _FOUND.get(parent)
    return found is None or found.kind != "top_k" or not found.made_by or child.name in found.made_by


def analyze(layer: keras.layers.Layer) -> None:
    """Traces a 16-bit user-code ``layer`` once (unless done) and records, for it and each
    sublayer, the widest finding of this rule and of each of `SCANNERS`."""
    if layer not in _FOUND:
        _analyze(layer)


def _analyze(layer: keras.layers.Layer) -> None:
    """Traces ``layer`` and records the widest finding of it and each sublayer."""
    if layer.compute_dtype not in LOW_PRECISION or not _runs_user_code(layer):
        return
    arguments = first_call_arguments(layer)
    graph = None if arguments is None else _trace(layer, *arguments)
    if graph is None:
        return
    for entry in walk(layer):
        _FOUND.setdefault(entry.layer, None)
    _FOUND[layer] = None
    for scan in SCANNERS:
        scan(layer, arguments, graph)
    makers: Dict[keras.layers.Layer, Set[str]] = {}  # top_k owner -> sublayers making ranked values
    whole: Set[int] = set()  # ids of owners whose every sublayer is forced with them
    for op in graph.get_operations():
        found = _finding(op)
        if found is None:
            continue
        owner = _scope_chain(layer, op.name)[-1]
        maker = _maker(layer, owner, op.inputs[0]) if found.kind == "top_k" else None
        if maker is None:
            whole.add(id(owner))
        else:
            makers.setdefault(owner, set()).add(maker.name)
        current = _FOUND.get(owner)
        if current is None or _rank(current) < _rank(found):
            _FOUND[owner] = found
    for owner, names in makers.items():
        if _FOUND[owner].kind == "top_k" and id(owner) not in whole:
            _FOUND[owner] = dataclasses.replace(_FOUND[owner], made_by=tuple(sorted(names)))


def _rank(found: WideReduction) -> tuple:
    """Which finding of one layer is said: the widest (unknown first)."""
    return found.extent is None, found.extent or 0


def _finding(op: tf.Operation) -> Optional[WideReduction]:
    """What `op` computes wrong in 16 bits, or None."""
    if not op.inputs or not op.outputs:
        return None
    dtype = (op.outputs[0] if op.type in ("Range", "Cast") + _UNIFORM_DRAWS else op.inputs[0]).dtype.name
    if dtype not in LOW_PRECISION:
        return None
    if op.type in _UNIFORM_DRAWS:
        return WideReduction("uniform draw", None, dtype) if _compared(op.outputs[0]) else None
    if op.type in _SUMS:
        if dtype != "float16":
            return None
        extent, kind = _extent(op), _kind(op)
        if kind == "sum of exp" or (extent is not None and extent > FLOAT16_MAX):
            return WideReduction(kind, extent or 1)
        return None
    if op.type == "TopKV2":
        return WideReduction("top_k", op.inputs[0].shape[-1] if op.inputs[0].shape.rank else None, dtype)
    if op.type in _ACCUMULATIONS:
        extent = _accumulated(op)
        kind = re.sub(r"(?<!^)(?=[A-Z])", "_", re.sub(r"(V2|WithNumSegments)$", "", op.type)).lower()
    elif op.type == "Range":
        extent, kind = _largest_position(op), "range"
    elif op.type == "Cast" and op.inputs[0].dtype.is_integer:
        source = _range_source(op.inputs[0].op)
        if source is None:
            return None
        extent, kind = _largest_position(source), "range"
    else:
        return None
    if extent is not None and extent <= EXACT_INTEGER_LIMIT[dtype]:
        return None
    return WideReduction(kind, extent, dtype)


def _accumulated(op: tf.Operation) -> Optional[int]:
    """Inputs an accumulation op sums or multiplies into one output, at most (static sizes), or None."""
    data, second = op.inputs[0], op.inputs[1]
    if op.type.startswith("Cum"):
        axis = tf.get_static_value(second)
        return None if axis is None or data.shape.rank is None else data.shape[int(axis) % data.shape.rank]
    if op.type.startswith("Sparse"):  # (data, indices, segment_ids[, num_segments])
        return second.shape[0] if second.shape.rank else None
    if data.shape.rank is None or second.shape.rank is None:  # (data, segment_ids[, num_segments])
        return None
    sizes = data.shape[:second.shape.rank]
    return None if None in sizes else math.prod(sizes)


def _largest_position(op: tf.Operation) -> Optional[int]:
    """The largest magnitude a ``Range`` op yields (static bounds), or None."""
    bounds = [tf.get_static_value(x) for x in op.inputs]  # in the Range's dtype: compute in Python floats
    if any(bound is None for bound in bounds) or float(bounds[2]) == 0:
        return None
    start, limit, delta = (float(bound) for bound in bounds)
    count = max(0, math.ceil((limit - start) / delta))
    return 0 if count == 0 else int(max(abs(start), abs(start + (count - 1) * delta)))


def _compared(tensor: tf.Tensor, depth: int = 4) -> bool:
    """True when ``tensor`` reaches a comparison (`_COMPARISONS`) through a few ops (`_DRAW_MOVES`)."""
    for consumer in tensor.consumers():
        if consumer.type in _COMPARISONS or (
                depth > 0 and consumer.type in _DRAW_MOVES and _compared(consumer.outputs[0], depth - 1)):
            return True
    return False


def _range_source(op: tf.Operation, depth: int = 6) -> Optional[tf.Operation]:
    """The int ``Range`` whose values ``op`` yields unchanged (through a few index moves), or None."""
    if op.type == "Range":
        return op
    if depth == 0 or op.type not in _INDEX_MOVES or not op.inputs:
        return None
    return _range_source(op.inputs[0].op, depth - 1)


def _maker(layer: keras.layers.Layer, owner: keras.layers.Layer, values: tf.Tensor) -> Optional[keras.layers.Layer]:
    """The direct sublayer of ``owner`` making ``values`` (through order-keeping ops in ``owner``'s code), or None."""
    op = values.op
    for _ in range(len(_ORDER_KEEPING) + 1):
        chain = _scope_chain(layer, op.name)
        if owner not in chain:
            return None
        if chain[-1] is not owner:
            return chain[chain.index(owner) + 1]
        if op.type not in _ORDER_KEEPING or not op.inputs:
            return None
        op = op.inputs[0].op
    return None


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


def _scope_chain(layer: keras.layers.Layer, op_name: str) -> List[keras.layers.Layer]:
    """``layer`` and each sublayer whose ``__call__`` name scope (maybe suffixed ``_1``...) holds
    ``op_name``, outermost first: the last is the op's innermost owner."""
    chain = [layer]
    for scope in op_name.split("/")[1:-1]:
        child = next((c for c in child_layers(chain[-1])
                      if re.fullmatch(re.escape(c.name) + r"(?:_\d+)?", scope)), None)
        if child is None:
            break
        chain.append(child)
    return chain


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
