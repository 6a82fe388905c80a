"""Where one training step's time goes: TensorFlow ops by kind and by dtype, from a profiler trace.

`benchmarks/profile_step.py` traces a few training steps with TensorFlow's
profiler (``tf.profiler.experimental.start/stop``, which writes an XSpace,
``*.xplane.pb``) and hands the trace to `read_trace` and `breakdown` here.

Categories (`CATEGORIES`), by op type first and by name scope where the type
alone does not say (`classify`):

* ``matmul``: matrix products and convolutions (MatMul, BatchMatMulV2, Einsum,
  Conv2D and their backprops, and oneDNN's fused forms such as
  ``_MklNativeFusedMatMul``, whose name is the last op fused, e.g. ``.../Relu``).
* ``optimizer``: every op under the optimizer's name scope (``adam/...``,
  ``loss_scale_optimizer/...``) and ``ResourceApply*`` ops.
* ``cast``: Cast ops elsewhere (casts of weights to the compute dtype, of
  activations around float32 layers, of the loss).
* ``normalization``: FusedBatchNorm* ops, and every other op under a
  normalization layer's scope (``layer_normalization``, ``batch_normalization``,
  ResNet50's ``..._bn``): mean, variance, rsqrt and the rest.
* ``softmax``: Softmax, LogSoftmax and the softmax cross-entropy ops, and every
  op under a ``softmax`` scope (MultiHeadAttention's softmax layer, forward and
  gradient).
* ``elementwise``: what is left that touches tensors: arithmetic, activations,
  reductions, pooling, and data movement (Transpose, ConcatV2, GatherV2, Tile...).
* ``other``: bookkeeping: variable reads and writes outside the optimizer,
  shapes, reshapes, slices of shapes, control flow, the input iterator.
* ``host``: the part of the step's wall time when no op runs on any thread:
  the Python training loop, callbacks, dispatch.

Shares (`breakdown`): the ops' time is what the trace records per op, exclusive
of ops nested inside it, clipped to the timed steps. Ops run on up to two
threads at once here, so their summed time can exceed the wall time; each
category gets its part of the summed op time times the busy fraction of the
wall time (when at least one op runs), and ``host`` the rest, so the shares add
up to 1. The dtype of each op (its ``T``, ``dtype`` or ``DstT`` attribute, read
from the function definitions the trace names) splits the op time into 16-bit,
32-bit and other (integer, boolean, or unknown: ops Grappler created).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

CATEGORIES = ("matmul", "normalization", "softmax", "cast", "elementwise", "optimizer", "other", "host")
#: Op types (oneDNN prefixes ``_Mkl``, ``_MklNative`` and ``_`` removed) that start a matmul/conv.
MATMUL_PREFIXES = ("MatMul", "BatchMatMul", "FusedMatMul", "FusedBatchMatMul", "Conv2D", "Conv3D",
                   "FusedConv2D", "DepthwiseConv2dNative", "FusedDepthwiseConv2dNative", "Einsum",
                   "Conv2DWithBias", "QuantizedMatMul")
NORMALIZATION_PREFIXES = ("FusedBatchNorm", "BatchNorm")
SOFTMAX_TYPES = frozenset({"Softmax", "LogSoftmax", "SparseSoftmaxCrossEntropyWithLogits",
                           "SoftmaxCrossEntropyWithLogits"})
CAST_TYPES = frozenset({"Cast"})
OPTIMIZER_TYPE_PREFIXES = ("ResourceApply", "ApplyAdam", "ResourceSparseApply")
#: Bookkeeping op types (`other`).
BOOKKEEPING_TYPES = frozenset({
    "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "VarHandleOp",
    "Identity", "IdentityN", "NoOp", "Const", "Shape", "ShapeN", "Size", "Rank", "Reshape", "Squeeze",
    "ExpandDims", "StridedSlice", "Range", "Fill", "ZerosLike", "OnesLike", "Placeholder",
    "BroadcastArgs", "BroadcastGradientArgs", "IteratorGetNext", "OptionalFromValue",
    "OptionalGetValue", "OptionalHasValue", "OptionalNone", "_Arg", "_Retval", "_Send", "_Recv",
    "Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond", "StopGradient", "PreventGradient",
    "DestroyResourceOp", "_HostCast", "LogicalAnd", "LogicalNot", "Assert", "If", "StatelessIf",
})
#: Ops that hold other ops (function calls, loops): left out, their contents count.
CONTAINER_TYPES = frozenset({"StatefulPartitionedCall", "PartitionedCall", "While", "StatelessWhile",
                             "If", "StatelessIf", "Case", "StatelessCase"})
#: Optimizer name scopes when the optimizer is not known (Keras's default names).
DEFAULT_OPTIMIZER_SCOPES = frozenset({"adam", "adamw", "sgd", "rmsprop", "adagrad", "lamb", "lion",
                                      "nadam", "adamax", "adafactor", "ftrl", "loss_scale_optimizer"})
_NORM_SCOPE = re.compile(r"(normalization|layernorm|batchnorm|groupnorm)|(^|_)bn(_\d+)?$")
_SOFTMAX_SCOPE = re.compile(r"^softmax(_\d+)?$")
_ONEDNN_PREFIX = re.compile(r"^(_MklNative|_Mkl|_)")
_GRAPPLER_SEGMENT = re.compile(r"/\w*Optimizer/(?:\w*?Rewrite_)?(?:Leaf_\d+_)?")
SIXTEEN_BIT = frozenset({"bfloat16", "float16", "half"})
THIRTY_TWO_BIT = frozenset({"float32", "float"})


def base_type(op_type: str) -> str:
    """`op_type` without oneDNN's ``_Mkl`` / ``_MklNative`` / ``_`` prefix."""
    return _ONEDNN_PREFIX.sub("", op_type)


def classify(name: str, op_type: str,
             optimizer_scopes: Iterable[str] = DEFAULT_OPTIMIZER_SCOPES) -> str:
    """The category (one of `CATEGORIES` but ``host``) of one op.

    Args:
        name: String. The op's full name in the trace, e.g.
            ``"StatefulPartitionedCall/functional/dense/Relu"``.
        op_type: String. Its type, e.g. ``"_MklNativeFusedMatMul"``.
        optimizer_scopes: Strings. Name scopes of the optimizer (lowercase).

    Returns:
        String category.
    """
    base = base_type(op_type)
    segments = name.lower().split("/")[:-1]
    scopes = {s.lower() for s in optimizer_scopes}
    if base.startswith(OPTIMIZER_TYPE_PREFIXES) or any(s in scopes for s in segments):
        return "optimizer"
    if base.startswith(MATMUL_PREFIXES):
        return "matmul"
    if op_type in CAST_TYPES or base in CAST_TYPES:
        return "cast"
    if base.startswith(NORMALIZATION_PREFIXES) or any(_NORM_SCOPE.search(s) for s in segments):
        return "normalization"
    if base in SOFTMAX_TYPES or any(_SOFTMAX_SCOPE.match(s) for s in segments):
        return "softmax"
    if op_type in BOOKKEEPING_TYPES or base in BOOKKEEPING_TYPES:
        return "other"
    return "elementwise"


def width(dtype: Optional[str]) -> str:
    """``"16-bit"`` (bfloat16, float16), ``"32-bit"`` (float32), else ``"other"`` (ints, bool, unknown)."""
    if dtype in SIXTEEN_BIT:
        return "16-bit"
    if dtype in THIRTY_TWO_BIT:
        return "32-bit"
    return "other"


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One op execution in the trace (picoseconds on the trace's clock)."""

    start: int
    end: int
    name: str
    op_type: str
    thread: int


def read_trace(path: str) -> Tuple[List[OpEvent], List[int], List[str]]:
    """The op executions, the step markers and the function names of an ``.xplane.pb``.

    Args:
        path: String. An XSpace file written by ``tf.profiler.experimental.stop``.

    Returns:
        Tuple ``(ops, markers, functions)``: `OpEvent` list (ops of the host
        plane, containers left out, each XLA-compiled run as one op of type
        `XLA_TYPE`, classified by its scope like any op), the start times (ps) of events named
        `profile_step.MARKER`, and the names of TensorFlow functions the trace
        mentions (``__inference_...``).
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # TensorFlow's own copy

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    ops, markers, functions = [], [], set()
    for plane in space.planes:
        if not plane.name.startswith("/host:"):
            continue
        functions.update(s.name for s in plane.stat_metadata.values() if s.name.startswith("__inference_"))
        names = {key: meta.name for key, meta in plane.stat_metadata.items()}
        for thread, line in enumerate(plane.lines):
            origin = line.timestamp_ns * 1000
            launch = (0, "")  # end and op name of the async op (an XLA call) running on this thread
            for event in line.events:
                label = plane.event_metadata[event.metadata_id].name
                start = origin + event.offset_ps
                if label == MARKER:
                    markers.append(start)
                elif label == ASYNC_OP:
                    stats = {names.get(stat.metadata_id): stat.str_value or names.get(stat.ref_value, "")
                             for stat in event.stats}  # a string stat: its value, or a reference to it
                    launch = (start + event.duration_ps, stats.get("name") or XLA_TYPE)
                elif label == XLA_RUN:
                    name = launch[1] if start < launch[0] else XLA_TYPE
                    ops.append(OpEvent(start, start + event.duration_ps, name, XLA_TYPE, thread))
                elif "::" not in label:  # not the runtime's own events (ExecutorState::Process, Iterator::...)
                    name, sep, op_type = label.rpartition(":")
                    if sep and name and op_type and " " not in op_type and op_type not in CONTAINER_TYPES:
                        ops.append(OpEvent(start, start + event.duration_ps, name, op_type, thread))
    return ops, sorted(markers), sorted(functions)


#: Name of the zero-length trace event `profile_step` records at the end of each step.
MARKER = "tfmp_benchmark_step_end"
#: The runtime's event of an XLA-compiled function's run on the CPU (its fused loops are no ops of the
#: trace), recorded as an op of type `XLA_TYPE` named after the async op launching it (`ASYNC_OP`).
XLA_RUN = "CpuExecutable::ExecuteAsyncOnStream"
ASYNC_OP = "ExecutorState::ProcessAsync::Start"
XLA_TYPE = "XlaExecutable"


def _node_dtype(node) -> Optional[str]:
    from tensorflow.python.framework import dtypes

    for key in ("T", "dtype", "DstT"):
        if key in node.attr and node.attr[key].type:
            return dtypes.as_dtype(node.attr[key].type).name
    return None


def function_dtypes(functions: Sequence[str]) -> Dict[str, str]:
    """Op name (as the trace spells it after inlining) -> dtype, from the named functions.

    A call op ``C`` of function ``f`` names ``f``'s op ``x`` as ``C/x`` in the
    trace, so nested functions are walked with their call op's name as prefix.

    Args:
        functions: Names of functions registered in the eager context.

    Returns:
        Dict of op name -> dtype name (only ops with a dtype attribute).
    """
    from tensorflow.python.eager import context

    out: Dict[str, str] = {}

    def walk(function: str, prefix: str, depth: int) -> None:
        try:
            definition = context.context().get_function_def(function)
        except Exception:  # not registered (a function of another process or of tf.data)
            return
        for node in definition.node_def:
            dtype = _node_dtype(node)
            if dtype:
                out.setdefault(prefix + node.name, dtype)
            callee = node.attr["f"].func.name if "f" in node.attr else ""
            if callee and depth < 8:
                walk(callee, prefix + node.name + "/", depth + 1)

    for function in functions:
        walk(function, "", 0)
    return out


def lookup_dtype(name: str, dtypes: Mapping[str, str]) -> Optional[str]:
    """The dtype of op `name`, trying Grappler's renamed forms (``.../ArithmeticOptimizer/..._add``)."""
    if name in dtypes:
        return dtypes[name]
    return dtypes.get(_GRAPPLER_SEGMENT.sub("/", name))


def exclusive_times(ops: Sequence[OpEvent], window: Tuple[int, int]) -> List[int]:
    """Each op's time (ps) inside `window`, less the ops nested inside it on its thread."""
    lo, hi = window
    clipped = [max(0, min(op.end, hi) - max(op.start, lo)) for op in ops]
    own = list(clipped)
    by_thread: Dict[int, List[int]] = collections.defaultdict(list)
    for i, op in enumerate(ops):
        by_thread[op.thread].append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (ops[i].start, -ops[i].end))
        stack: List[int] = []
        for i in indices:
            while stack and ops[stack[-1]].end <= ops[i].start:
                stack.pop()
            if stack and ops[i].end <= ops[stack[-1]].end:
                own[stack[-1]] -= clipped[i]
            stack.append(i)
    return [max(0, t) for t in own]


def busy_time(ops: Sequence[OpEvent], window: Tuple[int, int]) -> int:
    """Picoseconds of `window` during which at least one op runs (any thread)."""
    lo, hi = window
    spans = sorted((max(op.start, lo), min(op.end, hi)) for op in ops if op.end > lo and op.start < hi)
    total, current_start, current_end = 0, None, None
    for start, end in spans:
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def breakdown(
    ops: Sequence[OpEvent], window: Tuple[int, int], steps: int, dtypes: Mapping[str, str],
    optimizer_scopes: Iterable[str] = DEFAULT_OPTIMIZER_SCOPES,
) -> dict:
    """Shares of the step's wall time per category and per dtype width.

    Args:
        ops: `OpEvent` list.
        window: ``(start, end)`` in ps: the timed steps (marker to marker).
        steps: Int >= 1. Steps inside `window`.
        dtypes: Op name -> dtype (`function_dtypes`).
        optimizer_scopes: Strings. The optimizer's name scopes.

    Returns:
        Dict: ``step_ms``; ``shares`` (category -> share of wall time, the
        `CATEGORIES` adding up to 1); ``width_of_ops`` (``"16-bit"``,
        ``"32-bit"``, ``"other"`` -> share of the op time); ``width_by_category``
        (category -> width -> share of that category's op time);
        ``busy_fraction``; ``top_ops`` (the 8 op types of most time: type,
        category, share of op time).
    """
    scopes = frozenset(s.lower() for s in optimizer_scopes)
    wall = max(1, window[1] - window[0])
    own = exclusive_times(ops, window)
    total = sum(own) or 1
    by_category: Dict[str, float] = collections.Counter()
    by_width: Dict[str, float] = collections.Counter()
    by_both: Dict[Tuple[str, str], float] = collections.Counter()
    by_type: Dict[Tuple[str, str], float] = collections.Counter()
    for op, t in zip(ops, own):
        if not t:
            continue
        category = classify(op.name, op.op_type, scopes)
        bits = width(lookup_dtype(op.name, dtypes))
        by_category[category] += t
        by_width[bits] += t
        by_both[category, bits] += t
        by_type[op.op_type, category] += t
    busy = busy_time(ops, window) / wall
    shares = {c: by_category.get(c, 0) / total * busy for c in CATEGORIES[:-1]}
    shares["host"] = 1.0 - busy
    widths = ("16-bit", "32-bit", "other")
    return {
        "step_ms": wall / steps / 1e9,
        "shares": shares,
        "busy_fraction": busy,
        "width_of_ops": {w: by_width.get(w, 0) / total for w in widths},
        "width_by_category": {
            c: {w: by_both.get((c, w), 0) / by_category[c] for w in widths}
            for c in CATEGORIES[:-1] if by_category.get(c)
        },
        "top_ops": [
            {"type": op_type, "category": category, "share_of_op_time": t / total}
            for (op_type, category), t in by_type.most_common(8)
        ],
    }
