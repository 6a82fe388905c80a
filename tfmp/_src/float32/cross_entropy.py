"""A bfloat16 model's from-logits sparse cross-entropy read from its 16-bit logits, in two fused passes.

Keras's loss reads the logits cast to float32 (``Loss.__call__``, or tfmp's logits rule), and
TensorFlow's CPU ``SparseSoftmaxCrossEntropyWithLogits`` writes a float32 gradient of their
size, which a Cast rounds back to 16 bits: three ops over logits-sized tensors, each reading or
writing float32. `fused` reads the 16-bit logits once forward (float32 log-sum-exp and label logit per
row) and once backward (softmax minus one-hot, times the upstream gradient, rounded once), each
pass one XLA-compiled loop. The rule (`decision`): a bfloat16 model on a machine without GPUs
or TPUs. Where one step's 16-bit logits are larger than `FUSED_ABOVE_BYTES` and come from a Keras
``Dense`` or projecting ``ReversibleEmbedding`` (`projection_graph.output_projection`), the loss
is fused with that projection instead (`fused_cross_entropy`, as
`tfmp.ChunkedSparseCategoricalCrossentropy` computes it): the logits are never whole, and the
projection's full-size matmul is pruned. Measurements: benchmarks/README.md, "Cross-entropy from
16-bit logits".
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from tfmp._src.float32 import inside
from tfmp._src.keras_hooks import backend_ops, projection_graph
from tfmp._src.policy.hardware import DeviceFacts

#: The one compute dtype changed (the one measured: float16 is never tfmp's choice on a CPU).
DTYPE = "bfloat16"
#: Why a bfloat16 model on a CPU takes `fused` (``Attachment.cross_entropy`` after the colon).
RULE = ("TensorFlow's CPU cross-entropy reads the 16-bit logits cast to float32 and writes a float32 "
        "gradient of their size; read from the bfloat16 logits in two passes, or fused with the output "
        "projection where a step's logits exceed 1 GiB (benchmarks/README.md, \"Cross-entropy from 16-bit logits\")")
#: The start of the error a label outside ``[0, classes)`` raises, as TensorFlow's own kernel words it.
OUT_OF_RANGE = "Received a label value outside the valid range of [0, {classes})"
#: Bytes of one step's 16-bit logits above which the loss is fused with the output projection: 1 GiB.
#: Below it the two passes are faster (the fused loss computes the logits twice, 1.1-1.6x their time,
#: benchmarks/README.md); above it they keep two tensors of the logits' size (logits and gradient,
#: over 2 GiB), the fused loss none.
FUSED_ABOVE_BYTES = 2**30


#: Bytes of float32 values one XLA-compiled block of the forward works on (rows x classes x 4): XLA's CPU
#: backend writes a reduction's input out whole, so the forward takes rows a block at a time.
BLOCK_BYTES = 4 * 2**20


def _block_forward(logits: Any, labels: Any) -> Tuple[Any, Any]:
    """``(losses, log_sum_exp)`` of a block of rows, float32 ``[size]`` each; labels in range."""
    import tensorflow as tf

    wide = tf.cast(logits, tf.float32)
    top = tf.reduce_max(wide, axis=-1)
    log_sum_exp = tf.math.log(tf.reduce_sum(tf.exp(wide - top[:, None]), axis=-1)) + top
    return log_sum_exp - tf.gather(wide, labels, axis=1, batch_dims=1), log_sum_exp


def _forward(logits: Any, labels: Any, valid: Any) -> Tuple[Any, Any]:
    """``(losses, log_sum_exp)``: float32 ``[rows]`` each; a row whose label is not `valid` loses NaN.

    Rows are taken ``BLOCK_BYTES // (4 * classes)`` at a time, each block one XLA-compiled call (the
    last block ends at the last row and recomputes rows of the block before, to the same values): XLA's
    float32 temporaries are one block, not the logits' size (measured, one call: 254 MiB of temporaries
    for 2,048 x 32,000 logits, even looping inside it, as XLA hoists the cast out of its loop)."""
    import tensorflow as tf

    rows, classes = tf.shape(logits)[0], tf.shape(logits)[1]
    index = tf.clip_by_value(labels, 0, classes - 1)
    block = inside.xla_compiled(_block_forward)
    if logits.shape.num_elements() is not None and 4 * logits.shape.num_elements() <= BLOCK_BYTES:
        losses, log_sum_exp = block(logits, index)  # one block: no loop
        return tf.where(valid, losses, float("nan")), log_sum_exp
    size = tf.clip_by_value(BLOCK_BYTES // (4 * classes), 1, tf.maximum(rows, 1))

    def body(step, losses, sums):
        first = tf.minimum(step * size, rows - size)
        part_losses, part_sums = block(tf.slice(logits, [first, 0], [size, classes]), tf.slice(index, [first], [size]))
        at = (first + tf.range(size))[:, None]
        return step + 1, tf.tensor_scatter_nd_update(losses, at, part_losses), \
            tf.tensor_scatter_nd_update(sums, at, part_sums)

    zeros = tf.zeros([rows], tf.float32)
    blocks = (rows + size - 1) // size
    _, losses, log_sum_exp = tf.while_loop(lambda step, *_: step < blocks, body, (0, zeros, zeros))
    return tf.where(valid, losses, float("nan")), log_sum_exp


def _backward(logits: Any, labels: Any, log_sum_exp: Any, upstream: Any) -> Any:
    """``(softmax - one_hot) * upstream`` per row, in float32, rounded once to the logits' dtype."""
    import tensorflow as tf

    probabilities = tf.exp(tf.cast(logits, tf.float32) - log_sum_exp[:, None])
    one_hot = tf.one_hot(labels, tf.shape(logits)[-1], dtype=tf.float32)
    return tf.cast((probabilities - one_hot) * tf.cast(upstream, tf.float32)[:, None], logits.dtype)


def fused(labels: Any, logits: Any) -> Any:
    """Per-row cross-entropy of 16-bit logits, computed in float32, with its gradient in the logits' dtype.

    Equal to ``tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.cast(logits, tf.float32))``
    within float32 rounding; its gradient equals that one's cast to the logits' dtype within one
    rounding. No float32 tensor of the logits' size is kept between the passes.

    Args:
        labels: Integer tensor ``[rows]``, class ids in ``[0, classes)``.
        logits: bfloat16 or float16 tensor ``[rows, classes]``.

    Returns:
        float32 tensor ``[rows]``.

    Raises:
        tf.errors.InvalidArgumentError: a label outside ``[0, classes)`` (`OUT_OF_RANGE`), where the
            graph runs its assertions (under XLA, which drops them, that row's loss is NaN instead,
            which tfmp's guard skips and says).
    """
    import tensorflow as tf

    labels, valid = _checked_labels(labels, logits.shape[-1])

    @tf.custom_gradient
    def cross_entropy(logits: Any) -> Any:
        losses, log_sum_exp = _forward(logits, labels, valid)

        def gradient(upstream: Any) -> Any:
            return inside.xla_compiled(_backward)(logits, labels, log_sum_exp, upstream)

        return losses, gradient

    return cross_entropy(logits)


def _checked_labels(labels: Any, classes: int) -> Tuple[Any, Any]:
    """``(labels, valid)``: `labels` as int32 and where they are in ``[0, classes)``, asserted where the graph
    runs assertions: the error names the first label outside, as TensorFlow's kernel does (`OUT_OF_RANGE`,
    then that label and its flat position)."""
    import tensorflow as tf

    labels = tf.cast(labels, tf.int32)
    outside = tf.logical_or(labels < 0, labels >= classes)
    where = tf.argmax(tf.cast(outside, tf.int32), output_type=tf.int32)
    tf.debugging.Assert(tf.logical_not(tf.reduce_any(outside)),  # run by tf.function's automatic
                        [OUT_OF_RANGE.format(classes=classes) + ": label", tf.gather(labels, where),  # control
                         "at flat position", where, "(fix the data, or use ignore_class for padding)"])  # deps
    return labels, tf.logical_not(outside)


def fused_with_projection(labels: Any, projection: projection_graph.Projection) -> Any:
    """Per-row cross-entropy of the logits `projection` outputs, never whole (`fused_cross_entropy`).

    Args:
        labels: Integer tensor ``[rows]``, class ids in ``[0, classes)``.
        projection: The output projection of the logits (`projection_graph.output_projection`).

    Returns:
        float32 tensor ``[rows]``, equal to `fused` on the projection's logits within float32 rounding.

    Raises:
        tf.errors.InvalidArgumentError: as `fused` (under XLA: NaN in that row).
    """
    import tensorflow as tf

    from tfmp._src.float32 import fused_cross_entropy

    classes = fused_cross_entropy.classes_of(projection)
    labels, valid = _checked_labels(labels, classes)
    losses, _ = fused_cross_entropy.sparse_cross_entropy(tf.clip_by_value(labels, 0, classes - 1), projection,
                                                         None, uniform=False, chunk_bytes=fused_cross_entropy.CHUNK_BYTES)
    return tf.where(valid, losses, float("nan"))


def takes_projection(logits: Any) -> bool:
    """Bool. One step's `logits` (16-bit, shape known) are larger than `FUSED_ABOVE_BYTES`."""
    size = logits.shape.num_elements()
    return size is not None and size * logits.dtype.size > FUSED_ABOVE_BYTES


def decision(compute_dtype: str, facts: Optional[DeviceFacts] = None) -> str:
    """``Attachment.cross_entropy`` for a model computing in `compute_dtype` here (bfloat16 only, `inside.decided`)."""
    return inside.decided("cross_entropy", compute_dtype, DTYPE, RULE, facts)


def sixteen_bit_logits(output: Any) -> Optional[Any]:
    """The bfloat16 tensor a traced float32 `output` is a Cast of (`projection_graph.cast_from_16_bit`),
    with its classes known; else None."""
    source = projection_graph.cast_from_16_bit(output)
    if source is None or source.dtype.name != DTYPE:
        return None
    return source if source.shape.rank and source.shape[-1] is not None else None


def _replace(call: backend_ops.OpCall) -> Any:
    """Keras's ``sparse_categorical_crossentropy(target, output, from_logits=True)`` from the 16-bit logits."""
    import tensorflow as tf

    target, output = call.inputs
    logits = sixteen_bit_logits(output) if call.exact else None
    if logits is None or not inside.stepping_model_takes("cross_entropy"):
        return backend_ops.KERAS
    target = tf.convert_to_tensor(target)
    if target.shape.rank == logits.shape.rank and target.shape[-1] == 1:
        target = tf.squeeze(target, axis=-1)
    if target.shape.rank != logits.shape.rank - 1 or not target.shape.is_compatible_with(logits.shape[:-1]):
        return backend_ops.KERAS  # Keras raises its own shape error
    labels = tf.reshape(target, [-1])  # ids cast and checked in the functions below
    projection = projection_graph.output_projection(logits) if takes_projection(logits) else None
    if projection is not None:
        losses = fused_with_projection(labels, projection)
    else:
        losses = fused(labels, tf.reshape(logits, [-1, logits.shape[-1]]))
    return tf.reshape(losses, tf.shape(logits)[:-1])


def install() -> backend_ops.Hook:
    """Hooks Keras's TensorFlow backend ``sparse_categorical_crossentropy``; ``.remove()`` the `Hook` to undo."""
    return backend_ops.subscribe("sparse_categorical_crossentropy", _replace, owner="cross_entropy")
