"""A bfloat16 model's from-logits sparse cross-entropy read from its 16-bit logits, in two fused passes.

Keras's loss reads the logits cast to float32 (``Loss.__call__``, or tfmp's logits rule), and
TensorFlow's CPU ``SparseSoftmaxCrossEntropyWithLogits`` writes a float32 gradient of their
size, which a Cast rounds back to 16 bits: three ops over logits-sized tensors, each reading or
writing float32. `fused` reads the 16-bit logits once forward (float32 log-sum-exp and label logit per
row) and once backward (softmax minus one-hot, times the upstream gradient, rounded once), each
pass one XLA-compiled loop. The rule (`decision`): a bfloat16 model on a machine without GPUs
or TPUs. Measurements: benchmarks/README.md, "Cross-entropy from 16-bit logits".
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
        "gradient of their size (benchmarks/README.md, \"Cross-entropy from 16-bit logits\")")
#: The start of the error a label outside ``[0, classes)`` raises, as TensorFlow's own kernel words it.
OUT_OF_RANGE = "Received a label value outside the valid range of [0, {classes})"


def _forward(logits: Any, labels: Any) -> Tuple[Any, Any]:
    """``(losses, log_sum_exp)``: float32 ``[rows]`` each; a row whose label is out of range loses NaN."""
    import tensorflow as tf

    wide = tf.cast(logits, tf.float32)
    top = tf.reduce_max(wide, axis=-1)
    log_sum_exp = tf.math.log(tf.reduce_sum(tf.exp(wide - top[:, None]), axis=-1)) + top
    classes = tf.shape(logits)[-1]
    valid = tf.logical_and(labels >= 0, labels < classes)
    picked = tf.gather(wide, tf.clip_by_value(labels, 0, classes - 1), axis=1, batch_dims=1)
    return tf.where(valid, log_sum_exp - picked, float("nan")), log_sum_exp


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

    labels = tf.cast(labels, tf.int32)
    message = OUT_OF_RANGE.format(classes=logits.shape[-1])
    tf.debugging.assert_less(labels, tf.shape(logits)[-1], message=message)  # run by tf.function's
    tf.debugging.assert_non_negative(labels, message=message)  # automatic control dependencies

    @tf.custom_gradient
    def cross_entropy(logits: Any) -> Any:
        losses, log_sum_exp = inside.xla_compiled(_forward)(logits, labels)

        def gradient(upstream: Any) -> Any:
            return inside.xla_compiled(_backward)(logits, labels, log_sum_exp, upstream)

        return losses, gradient

    return cross_entropy(logits)


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
    losses = fused(tf.reshape(target, [-1]), tf.reshape(logits, [-1, logits.shape[-1]]))  # ids cast there
    return tf.reshape(losses, tf.shape(logits)[:-1])


def install() -> backend_ops.Hook:
    """Hooks Keras's TensorFlow backend ``sparse_categorical_crossentropy``; ``.remove()`` the `Hook` to undo."""
    return backend_ops.subscribe("sparse_categorical_crossentropy", _replace, owner="cross_entropy")
