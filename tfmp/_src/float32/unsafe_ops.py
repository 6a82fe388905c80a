"""The unsafe-op rules: a layer whose own code runs linear algebra, or a constant 16 bits cannot hold.

TensorFlow has no bfloat16 ``Cholesky``, ``MatrixInverse``, ``Qr`` or ``LogMatrixDeterminant``
(a Functional model fails while it is built), no CPU float16 kernel for most of them (``fit``
fails with "No OpKernel") and a float16 ``MatrixInverse`` about 10% off. A Python constant
beyond float16's range (``-1e9`` as an additive attention mask) becomes ``-inf``, then NaN.
Found by tracing a 16-bit layer's user code once on placeholders (`reductions`' trace); a
bfloat16 layer that cannot be traced is forced when its Functional build fails
(`force_at_build`, from `build_errors`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Dict, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfmp._src import errors
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.float32 import reductions
from tfmp._src.float32.reductions import _runs_user_code, _scope_chain, _trace
from tfmp._src.keras_hooks import error_texts
from tfmp._src.layer_tree import walk

#: TensorFlow's linear-algebra ops (``keras.ops.linalg``, ``keras.ops.slogdet``, ``tf.linalg``).
LINALG_OPS = frozenset({
    "Cholesky", "MatrixInverse", "Qr", "LogMatrixDeterminant", "MatrixDeterminant", "MatrixSolve",
    "MatrixTriangularSolve", "MatrixSolveLs", "SelfAdjointEigV2", "Svd", "Eig", "Lu",
    "MatrixExponential", "MatrixLogarithm", "MatrixSquareRoot",
})
#: The `LINALG_OPS` with a float16 CPU kernel in TensorFlow 2.21 (about 10% off); the others have none.
_FLOAT16_KERNELS = frozenset({"MatrixInverse", "Qr"})
#: The start of the reasons `tfmp.audit` shows for a layer these rules force.
LINALG = "16-bit linalg"
CONSTANT = "16-bit constant"


@dataclasses.dataclass(frozen=True)
class UnsafeOps:
    """What a layer's own code does that 16 bits cannot.

    Attributes:
        dtype: String. The layer's 16-bit compute dtype, ``"float16"`` or ``"bfloat16"``.
        linalg: Tuple of strings. TensorFlow op types of `LINALG_OPS` it runs, sorted.
        constants: Tuple of strings. Each constant it makes, as written (``"-1e+09"``), that
            is not finite in `dtype`.
    """

    dtype: str
    linalg: Tuple[str, ...] = ()
    constants: Tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """The reason `tfmp.audit` shows, e.g. ``"16-bit linalg: Cholesky in bfloat16"``."""
        if self.linalg:
            return f"{LINALG}: {', '.join(self.linalg)} in {self.dtype}"
        return f"{CONSTANT}: {', '.join(self.constants)} is not finite in {self.dtype}"

    def advice(self, path: str) -> str:
        """The cause, then the fix, said for the layer at ``path`` (``"cause. Fix"``: `tfmp.audit` shows it on
        one line, `tfmp.check_numerics` as its cause and fix lines; the guide's section has the rest)."""
        holds = f"{float(tf.as_dtype(self.dtype).max):.4g}"
        if self.linalg:
            off = [op for op in self.linalg if self.dtype == "float16" and op in _FLOAT16_KERNELS]
            missing = [op for op in self.linalg if op not in off]
            cause = "; ".join(
                ([f"TensorFlow has no {self.dtype}{' CPU' if self.dtype == 'float16' else ''} kernel for "
                  + ", ".join(missing)] if missing else [])
                + ([f"its float16 {', '.join(off)} is about 10% off"] if off else []))
            return f"{cause}. Compute it in float32: tfmp.register_float32('{path}') or tfmp.force_float32(model)."
        written = ", ".join(self.constants)
        return (f"its constant {written} is beyond {self.dtype}'s largest value ({holds}): -inf, then NaN. "
                f"Use a constant within +-{holds}{' (e.g. -3e4)' if self.dtype == 'float16' else ''}, "
                f"or tfmp.register_float32('{path}').")


#: The troubleshooting guide's section on these rules.
SECTION = "linear-algebra-and-constants-16-bits-cannot-hold"


def excluded_message(layer: keras.layers.Layer, refused: Tuple[str, ...], dtype: str) -> str:
    """The text of the TypeError for an excluded `layer` whose `refused` linalg ops have no `dtype` kernel."""
    return "tfmp: " + errors.opening(
        f"Layer '{layer.name}' ({type(layer).__name__}) runs {', '.join(refused)} on {dtype} inputs: "
        f"TensorFlow has no {dtype} kernel.",
        "An exclusion (exclude_float32= or tfmp.register_float32(..., exclude=True)) keeps it out of float32.",
        f"Fix: remove the exclusion matching '{layer.name}', create the layer with dtype=\"float32\", or cast "
        "its inputs to float32.", SECTION)


_FOUND: "weakref.WeakKeyDictionary[keras.layers.Layer, Optional[UnsafeOps]]" = weakref.WeakKeyDictionary()
#: Layers set to float32 when their Functional build failed in 16 bits.
_AT_BUILD: "weakref.WeakSet[keras.layers.Layer]" = weakref.WeakSet()


def unsafe_ops(layer: keras.layers.Layer) -> Optional[UnsafeOps]:
    """What ``layer``'s own 16-bit code does that 16 bits cannot, or None.

    Read from `reductions`' one trace; it also decides for every sublayer, so ask for parents first.
    """
    reductions.analyze(layer)
    return _FOUND.get(layer)


def reason(layer: keras.layers.Layer) -> Optional[str]:
    """`UnsafeOps.reason` of ``layer``, or None."""
    found = unsafe_ops(layer)
    return None if found is None else found.reason


def forced_at_build(layer: keras.layers.Layer) -> bool:
    """True when `force_at_build` set ``layer`` to float32 and it still computes in it."""
    return layer in _AT_BUILD and layer.compute_dtype == "float32"


def force_at_build(layer: keras.layers.Layer, args: tuple, kwargs: dict, error: BaseException,
                   retry: Any, excluded: bool) -> Any:
    """``retry(*args, **kwargs)`` with ``layer`` and its 16-bit float symbolic inputs in float32, when `error`
    is TensorFlow refusing ``layer``'s 16-bit dtype in a linalg op.

    Returns what ``retry`` returns. Raises `error` itself when it is another failure, and a
    ``TypeError`` naming the layer, the op and the fix when ``excluded`` keeps it out of float32.
    """
    dtype = layer.compute_dtype
    if dtype not in LOW_PRECISION or not _runs_user_code(layer) or not error_texts.refused_dtype(error):
        raise error

    def in_float32(x: Any) -> Any:
        if isinstance(x, keras.KerasTensor) and x.dtype in LOW_PRECISION:
            return keras.KerasTensor(x.shape, "float32", sparse=x.sparse, ragged=x.ragged)
        return x

    args, kwargs = keras.tree.map_structure(in_float32, (tuple(args), dict(kwargs)))
    policy = layer.dtype_policy.name
    layer.dtype_policy = "float32"
    try:
        result = retry(*args, **kwargs)
        graph = _trace(layer, args, kwargs)
    except Exception:
        layer.dtype_policy = policy
        raise error
    refused = _refused_ops(graph, dtype)
    if not refused or excluded:
        layer.dtype_policy = policy
        if not refused:
            raise error
        raise TypeError(excluded_message(layer, refused, dtype)) from error
    _AT_BUILD.add(layer)
    _FOUND[layer] = UnsafeOps(dtype, refused)
    return result


def _refused_ops(graph: Optional[tf.Graph], dtype: str) -> Tuple[str, ...]:
    """The `LINALG_OPS` of a float32 ``graph`` whose op definition refuses ``dtype``."""
    if graph is None:
        return ()
    refused = set()
    for op in graph.get_operations():
        if op.type not in LINALG_OPS:
            continue
        allowed = [attr.allowed_values.list.type for attr in op.op_def.attr if attr.type == "type"]
        if any(values and tf.as_dtype(dtype).as_datatype_enum not in values for values in allowed):
            refused.add(op.type)
    return tuple(sorted(refused))


def _scan(layer: keras.layers.Layer, arguments: tuple, graph: tf.Graph) -> None:
    """Records what a 16-bit ``layer`` traced on ``arguments`` into ``graph`` and each sublayer do unsafely."""
    for entry in walk(layer):
        _FOUND.setdefault(entry.layer, None)
    _FOUND[layer] = None
    linalg: Dict[Any, set] = {}
    constants: Dict[Any, Dict[str, float]] = {}
    def owner(op: tf.Operation) -> Any:
        return _scope_chain(layer, op.name)[-1]

    for op in graph.get_operations():
        if op.type in LINALG_OPS and op.inputs and op.inputs[0].dtype.name in LOW_PRECISION:
            linalg.setdefault(owner(op), set()).add(op.type)
        elif op.type == "Const" and op.outputs[0].dtype.name in LOW_PRECISION:
            value = np.asarray(tf.get_static_value(op.outputs[0]), "float32").ravel()
            if not np.all(np.isfinite(value)):
                constants.setdefault(owner(op), {})[op.name] = float(value[~np.isfinite(value)][0])
    for owner, types in linalg.items():
        _FOUND[owner] = UnsafeOps(owner.compute_dtype, tuple(sorted(types)))
    for owner, names in constants.items():
        written = _as_written(layer, owner, arguments, names)
        if written and _FOUND.get(owner) is None:
            _FOUND[owner] = UnsafeOps(owner.compute_dtype, constants=written)


def _as_written(root: keras.layers.Layer, owner: keras.layers.Layer, arguments: tuple,
                names: Dict[str, float]) -> Tuple[str, ...]:
    """The values of ``owner``'s non-finite 16-bit constants (op name -> value) as its code wrote them.

    Read from a float32 trace (``owner`` and its sublayers set to float32 for it, as forcing would):
    a constant infinite there too (a deliberate ``-inf``) is left out; one the float32 trace does not
    make is said as its 16-bit value.
    """
    largest = float(tf.as_dtype(owner.compute_dtype).max)
    policies = {layer: layer.dtype_policy for layer in [owner] + [entry.layer for entry in walk(owner)]}
    try:
        for layer in policies:
            layer.dtype_policy = "float32"
        graph = _trace(root, *arguments)
    finally:
        for layer, policy in policies.items():
            layer.dtype_policy = policy
    written = []
    for name, low in names.items():
        try:
            value = tf.get_static_value(graph.get_operation_by_name(name).outputs[0])
        except (AttributeError, KeyError, ValueError):  # no float32 graph, or no such constant in it
            written.append(f"{low:g}")
            continue
        value = np.asarray(value, "float64").ravel()
        beyond = value[np.isfinite(value) & (np.abs(value) > largest)]
        if beyond.size:
            written.append(f"{float(beyond[0]):g}")
    return tuple(dict.fromkeys(written))


reductions.SCANNERS.append(_scan)
