"""The output-projection surface: the TensorFlow ops a Keras output projection traces to under ``tf.function``.

A fused cross-entropy (`tfmp._src.float32.fused_cross_entropy`) computes the logits itself, a
chunk at a time, from what the projection multiplies; it finds those by walking back from the
logits tensor it receives through the ops Keras's TensorFlow backend writes:

| op (from the logits back) | where in Keras | what `output_projection` takes |
|---|---|---|
| ``IdentityN`` of a bias add (optional) | ``tf.custom_gradient`` of tfmp's ``float32/bias_gradient.py`` | (its input: the fused loss sums the bias gradient in float32 itself) |
| ``BiasAdd`` / ``Add`` / ``AddV2`` of a 1-D tensor (optional) | ``Dense.call``: ``ops.add(x, self.bias)`` | the bias |
| ``Reshape`` (optional) | ``backend/tensorflow/numpy.py`` ``matmul``: ``tf.tensordot`` of a 3-D input | (its input) |
| ``MatMul`` (or ``BatchMatMulV2``/``V3`` against a 2-D kernel) | ``ops.matmul(inputs, kernel)`` | the 2-D hidden states and the kernel, ``transpose_b`` |
| ``Transpose`` ``[1, 0]`` of the kernel (optional) | ``ReversibleEmbedding.call(reverse=True)``: ``ops.transpose(embeddings)`` | the embedding matrix, transposed |
| ``Cast`` float32 -> 16-bit of kernel or bias (optional) | ``Layer`` autocast of a mixed policy's float32 variables | the float32 value (its gradient stays float32) |

`cast_from_16_bit` reads the one op a from-logits cross-entropy's float32 logits come from
(`tfmp._src.float32.cross_entropy`): Keras's ``Loss.__call__`` converting 16-bit logits to its
float32 dtype, a ``Cast``, whose 16-bit input the loss then reads instead.

Only ops of the graph being built are followed; anything else (eager tensors, a soft cap, an
activation) is no match, and the caller computes from the logits as they are. `pattern_matches`
checks once per process that a Keras ``Dense`` still traces to this pattern; where it does
not (a newer Keras), the optional feature ``fused_projection`` is switched off with one warning.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Optional

import tensorflow as tf

from tfmp._src.keras_hooks import availability

FEATURE = "fused_projection"
_ADDS = ("BiasAdd", "Add", "AddV2")
_MATMULS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3")
_LOW = (tf.bfloat16, tf.float16)


class Projection(NamedTuple):
    """What an output projection multiplies: ``logits = round(hidden @ kernel[^T]) + bias``, in ``dtype``.

    hidden: ``[rows, depth]`` tensor of ``dtype`` (the projection's input, tokens flattened).
    kernel: ``[depth, classes]`` (``[classes, depth]`` with ``transpose``) tensor of ``dtype`` or float32
        (a float32 variable's value before the layer's cast; rounded to ``dtype`` before use).
    transpose: Bool. The kernel is ``[classes, depth]`` (a tied embedding matrix).
    bias: ``[classes]`` tensor of ``dtype`` or float32, or None.
    dtype: The logits' dtype (the layer's compute dtype).
    bias_on_product: Bool. The bias is added to a ``MatMul``'s own output (2-D hidden states), an add
        TensorFlow's remapper fuses into oneDNN's matmul with one rounding; False: after a reshape or a
        ``BatchMatMulV2`` (Keras 3.12's 3-D Dense), which it left unfused (measured, TF 2.17 and 2.21).
    """

    hidden: tf.Tensor
    kernel: tf.Tensor
    transpose: bool
    bias: Optional[tf.Tensor]
    dtype: tf.DType
    bias_on_product: bool = False


def _graph_tensor(value: Any) -> bool:
    return isinstance(value, tf.Tensor) and not tf.executing_eagerly() and \
        getattr(value, "graph", None) is tf.compat.v1.get_default_graph()


def _before_cast(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """The float32 input of a float32 -> ``dtype`` ``Cast`` producing ``tensor``, else ``tensor``."""
    op = tensor.op
    if dtype in _LOW and op.type == "Cast" and op.inputs[0].dtype == tf.float32 and \
            not op.get_attr("Truncate"):
        return op.inputs[0]
    return tensor


def cast_from_16_bit(tensor: Any) -> Optional[tf.Tensor]:
    """The bfloat16 or float16 input of a ``Cast`` to float32 producing `tensor` in the graph being built, else None."""
    if not _graph_tensor(tensor) or tensor.dtype != tf.float32:
        return None
    op = tensor.op
    if op.type != "Cast" or op.inputs[0].dtype not in _LOW or op.get_attr("Truncate"):
        return None
    return op.inputs[0]


def _split_bias(tensor: tf.Tensor, classes: int):
    """``(before the bias add, bias)`` of ``tensor``; bias None when it is no bias add over the last axis."""
    op = tensor.op
    if op.type == "IdentityN" and op.inputs[tensor.value_index].op.type in _ADDS:
        op = op.inputs[tensor.value_index].op  # tfmp's float32-summed bias gradient (`bias_gradient`)
    if op.type not in _ADDS or len(op.inputs) != 2:
        return tensor, None
    if op.type == "BiasAdd" and op.get_attr("data_format") not in (b"NHWC", "NHWC"):
        return tensor, None
    for value, bias in (op.inputs, reversed(op.inputs)):
        if bias.shape.rank == 1 and bias.shape[0] == classes and value.shape.rank is not None and \
                value.shape.rank >= 2 and value.dtype == tensor.dtype == bias.dtype:
            return value, bias
    return tensor, None


@tf.autograph.experimental.do_not_convert  # plain Python over the graph's ops, also inside a Keras step
def output_projection(logits: Any) -> Optional[Projection]:
    """The `Projection` whose output ``logits`` (``[..., classes]``, a tensor of the graph being built) is.

    None when ``logits`` is eager, of another graph, not the pattern of this module's table,
    or the feature is off. Never raises.
    """
    if not _graph_tensor(logits) or logits.shape.rank is None or logits.shape.rank < 2 or \
            logits.shape[-1] is None or availability.off(FEATURE) or not pattern_matches():
        return None
    try:
        return _walk(logits)
    except (ValueError, TypeError, AttributeError):  # an op without the attribute read: no match
        return None


@tf.autograph.experimental.do_not_convert
def _walk(logits: tf.Tensor) -> Optional[Projection]:
    classes, dtype = int(logits.shape[-1]), logits.dtype
    product, bias = _split_bias(logits, classes)
    bias_on_product = bias is not None and product.op.type == "MatMul"  # fused by the remapper (measured)
    if product.op.type == "Reshape":
        product = product.op.inputs[0]
    op = product.op
    if op.type not in _MATMULS:
        return None
    hidden, kernel = op.inputs
    if op.type == "MatMul":
        if op.get_attr("transpose_a") or hidden.shape.rank != 2:
            return None
        transpose = bool(op.get_attr("transpose_b"))
    else:
        if op.get_attr("adj_x") or kernel.shape.rank != 2 or hidden.shape.rank is None:
            return None
        transpose = bool(op.get_attr("adj_y"))
        hidden = tf.reshape(hidden, [-1, hidden.shape[-1]])
    if kernel.shape.rank != 2 or hidden.dtype != dtype or kernel.dtype != dtype:
        return None
    perm = tf.get_static_value(kernel.op.inputs[1]) if kernel.op.type == "Transpose" else None
    if perm is not None and list(perm) == [1, 0]:
        kernel, transpose = kernel.op.inputs[0], not transpose
    if kernel.shape[0 if transpose else 1] != classes or kernel.shape[1 if transpose else 0] is None:
        return None
    depth = int(kernel.shape[1 if transpose else 0])
    if hidden.shape[-1] is None:  # a tensordot of unknown batch size: the depth is the kernel's
        hidden = tf.reshape(hidden, [-1, depth])
    bias = None if bias is None else _before_cast(bias, dtype)
    return Projection(hidden, _before_cast(kernel, dtype), transpose, bias, dtype, bias_on_product)


_checked = {}
_checked_lock = threading.Lock()


def pattern_matches() -> bool:
    """True when a Keras ``Dense`` (3-D input, bias) and a tied ``ReversibleEmbedding`` projection trace to
    this module's pattern (checked once per process); else switches ``fused_projection`` off, warning once."""
    with _checked_lock:
        if "verdict" in _checked:
            return _checked["verdict"]
    try:
        with tf.init_scope():  # eager, outside the step being traced
            _probe()
        verdict = True
    except Exception as error:  # noqa: BLE001 - any failure means Keras moved the pattern
        availability.switch_off(FEATURE, error)
        verdict = False
    with _checked_lock:
        _checked["verdict"] = verdict
    return verdict


def _probe() -> None:
    """Raises LookupError when a Keras projection's graph is no longer the pattern `_walk` follows."""
    import keras

    dense = keras.layers.Dense(5, dtype="mixed_bfloat16")
    layers = [(dense, lambda x: dense(x), False)]
    reversible = getattr(keras.layers, "ReversibleEmbedding", None)
    if reversible is not None:
        embedding = reversible(5, 3, dtype="mixed_bfloat16")
        embedding.build((None,))
        layers.append((embedding, lambda x: embedding(x, reverse=True), True))
    for layer, call, transpose in layers:
        found = []

        def trace(x):
            logits = call(x)
            found.append(_walk(logits))
            return logits

        tf.function(trace, autograph=False).get_concrete_function(tf.TensorSpec([2, 4, 3], tf.bfloat16))
        projection = found[0]
        if projection is None or projection.transpose != transpose or projection.kernel.dtype != tf.float32 or \
                (projection.bias is None) == getattr(layer, "use_bias", False):
            raise LookupError(f"{type(layer).__name__}'s traced projection is not the pattern tfmp fuses "
                              f"(found {projection})")


def forget() -> None:
    """Forgets `pattern_matches`'s verdict (tests)."""
    with _checked_lock:
        _checked.clear()
