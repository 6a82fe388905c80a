"""Output projection and softmax cross-entropy fused: the logits are never whole, in float32 or 16 bits.

Given what the output projection multiplies (`tfmp._src.keras_hooks.projection_graph.Projection`:
hidden states ``[rows, depth]``, kernel, optional bias), the loss takes ``rows_per_chunk`` rows at
a time, computes that chunk's logits as the layer would output them (the matmul rounded to the
layer's compute dtype, then the bias added in it), and reduces them in float32 to one
log-sum-exp and one loss per row (`chunked_cross_entropy.row_terms`), as the chunked loss does
from whole logits. The layer's full-size matmul then has no consumer in the training step and
TensorFlow prunes it; a metric reading the logits keeps it (and still gets the layer's values).

Gradients (``tf.custom_gradient``, for hidden, kernel and bias): per chunk,
``g = softmax - target`` in float32, ``d_hidden = g @ kernel^T``, ``d_kernel += hidden^T @ g``,
``d_bias += sum(g)``. When every kept row's upstream gradient is the same (``uniform``: a Keras
reduction without sample weights, which weighs every kept row alike, `chunked_losses`), they are
computed in the forward loop and scaled once by the upstream gradient (as Liger-Kernel's fused
linear cross-entropy does); otherwise the backward loop recomputes each chunk's logits. A float32
kernel or bias (a mixed policy's variable before the layer's cast) gets its gradient in float32.

The chunk's matmul runs in float32 where the hardware has no fast 16-bit matmul (`float32_matmul`:
TensorFlow's 16-bit CPU matmul without oneDNN converts to float32 and back, so the result, rounded
once to the compute dtype, is the same) and in the compute dtype elsewhere.
Measurements: benchmarks/README.md, "Decoder loss".
"""

from __future__ import annotations

from typing import Optional, Tuple

import tensorflow as tf

from tfmp._src.float32.chunked_cross_entropy import (
    CHUNK_BYTES,
    chunk_plan,
    minus_target,
    row_terms,
    rows_per_chunk,
)
from tfmp._src.keras_hooks.projection_graph import Projection


def float32_matmul(dtype: tf.DType) -> bool:
    """True where a chunk's matmul is best run in float32: a float32 projection, or 16 bits on a machine
    without a GPU, a TPU or oneDNN's kernels for that dtype (`tfmp.DeviceFacts`: ``onednn_bfloat16``,
    ``onednn_float16``), where TensorFlow's 16-bit matmul runs through float32 copies (Eigen)."""
    from tfmp._src.policy.hardware import detect_device_facts

    if dtype == tf.float32:
        return True
    facts = detect_device_facts()
    fast = facts.onednn_bfloat16 if dtype == tf.bfloat16 else facts.onednn_float16
    return not (facts.gpus or facts.tpu or fast)


def sparse_cross_entropy(labels, projection: Projection, keep: Optional[tf.Tensor], *, uniform: bool,
                         label_smoothing: float = 0.0, ignore_class: Optional[int] = None,
                         chunk_bytes: int = CHUNK_BYTES) -> Tuple[tf.Tensor, Optional[tf.Tensor]]:
    """Per-row softmax cross-entropy of integer labels on the logits ``projection`` would output.

    Args:
        labels: Integer or float tensor of class ids, ``rows`` of them in any shape; in ``[0, classes)``
            except where equal to ``ignore_class``.
        projection: The output projection (`output_projection` of the logits).
        keep: Boolean ``[rows]`` tensor or None: rows outside it have loss 0 and gradient 0 (a Keras mask).
        uniform: Bool. Every kept row's upstream gradient is the same (gradients made in the forward loop).
        label_smoothing, ignore_class, chunk_bytes: As `chunked_cross_entropy.sparse_cross_entropy`.

    Returns:
        ``(loss, valid)``: float32 ``[rows]`` losses and the rows not ignored (None without ``ignore_class``).
    """
    ids = tf.reshape(tf.cast(labels, tf.int32), [-1])
    valid = None
    if ignore_class is not None:
        valid = tf.not_equal(ids, int(ignore_class))
        ids = tf.where(valid, ids, 0)
    keep = valid if keep is None else (keep if valid is None else tf.logical_and(keep, valid))
    return _fused(projection, ids, None, keep, uniform, float(label_smoothing), chunk_bytes), valid


def cross_entropy(labels, projection: Projection, keep: Optional[tf.Tensor], *, uniform: bool,
                  label_smoothing: float = 0.0, chunk_bytes: int = CHUNK_BYTES) -> tf.Tensor:
    """Per-row softmax cross-entropy of dense labels ``[..., classes]`` (read a chunk at a time) on the
    logits ``projection`` would output; arguments as `sparse_cross_entropy`. Float32 ``[rows]``."""
    classes = _classes(projection)
    dense = tf.reshape(tf.convert_to_tensor(labels), [-1, classes])
    return _fused(projection, None, dense, keep, uniform, float(label_smoothing), chunk_bytes)


def _classes(projection: Projection) -> int:
    return int(projection.kernel.shape[0 if projection.transpose else 1])


def _fused(projection: Projection, ids, dense, keep, uniform: bool, smoothing: float, chunk_bytes: int):
    """Float32 ``[rows]`` losses (0 outside ``keep``) of the logits ``projection`` outputs."""
    hidden, kernel, transpose, bias, dtype = projection
    classes = _classes(projection)
    size = rows_per_chunk(classes, chunk_bytes)
    offsets, step, chunks, size = chunk_plan(hidden, size)
    rows = tf.shape(hidden)[0]
    work = tf.float32 if float32_matmul(dtype) else dtype  # the matmuls' dtype

    def rounded(value):  # a kernel or bias as the layer multiplies it: in the compute dtype
        return tf.cast(tf.cast(value, dtype), work)

    def round_trip(value):  # a float32 tensor rounded to the compute dtype, as the layer's op outputs it
        return value if dtype == tf.float32 else tf.cast(tf.cast(value, dtype), tf.float32)

    def chunk(index, weights, shift):
        """Rows, live rows (in range and kept), hidden rows and float32 logits of chunk ``index``."""
        at = index * step + offsets
        rows_ids = tf.minimum(at, rows - 1)  # past the end: the last row again, not live
        live = at < rows
        if keep is not None:
            live = tf.logical_and(live, tf.gather(keep, rows_ids))
        part = tf.cast(tf.gather(hidden, rows_ids), work)
        product = tf.matmul(part, weights, transpose_b=transpose)
        if work != tf.float32:  # the layer's ops in its dtype
            logits = product if shift is None else tf.nn.bias_add(product, shift)
            return rows_ids, live, part, tf.cast(logits, tf.float32)
        logits = round_trip(product)  # the matmul's output rounding; a 16-bit add computes in float32, rounds
        return rows_ids, live, part, logits if shift is None else round_trip(tf.nn.bias_add(logits, shift))

    def gradients(softmax, rows_ids, live, part, weights, scale):
        """``(d_hidden rows, d_kernel, d_bias)`` of one chunk, float32: ``g = softmax - target`` times ``scale``."""
        scale = scale * tf.cast(live, tf.float32)
        g = minus_target(softmax, rows_ids, ids, dense, smoothing) * scale[:, None]
        low = tf.cast(g, work)
        d_part = tf.matmul(low, weights, transpose_b=not transpose)
        d_weights = tf.matmul(low, part, transpose_a=True) if transpose else tf.matmul(part, low, transpose_a=True)
        return tf.cast(d_part, tf.float32), tf.cast(d_weights, tf.float32), tf.reduce_sum(g, axis=0)

    def zeros_like_kernel():
        return tf.zeros(kernel.shape, tf.float32)

    def arrays(count, shape, dtype_=tf.float32):
        return [tf.TensorArray(dtype_, size=chunks, element_shape=shape) for _ in range(count)]

    def loop(body, state):
        return tf.while_loop(lambda i, *_: i < chunks, body, (0, *state), maximum_iterations=chunks,
                             parallel_iterations=1)[1:]

    depth = int(hidden.shape[-1])
    no_bias = bias is None

    @tf.custom_gradient
    def loss_of(hidden_in, kernel_in, *bias_in):
        weights = rounded(kernel_in)
        shift = None if no_bias else rounded(bias_in[0])
        ones = tf.ones([step], tf.float32)

        def forward(index, lse_array, loss_array, *grads):
            rows_ids, live, part, tile = chunk(index, weights, shift)
            if not uniform:
                lse, loss = row_terms(tile, rows_ids, ids, dense, smoothing)
                return index + 1, lse_array.write(index, lse), loss_array.write(index, tf.where(live, loss, 0.0))
            lse, loss, softmax = row_terms(tile, rows_ids, ids, dense, smoothing, softmax=True)
            out = (index + 1, lse_array.write(index, lse), loss_array.write(index, tf.where(live, loss, 0.0)))
            d_part, d_weights, d_shift = gradients(softmax, rows_ids, live, part, weights, ones)
            d_hidden, d_kernel, d_bias = grads
            return out + (d_hidden.write(index, d_part), d_kernel + d_weights, d_bias + d_shift)

        state = arrays(2, [size])
        if uniform:
            state += arrays(1, [size, depth]) + [zeros_like_kernel(), tf.zeros([classes], tf.float32)]
        lse_array, loss_array, *found = loop(forward, state)
        lse = tf.reshape(lse_array.stack(), [-1])[:rows]
        loss = tf.reshape(loss_array.stack(), [-1])[:rows]

        def grad(upstream):
            upstream = tf.cast(upstream, tf.float32)
            if uniform:  # every kept row's upstream gradient is that of the first kept one
                first = 0 if keep is None else tf.argmax(tf.cast(keep, tf.int32), output_type=tf.int32)
                d_hidden = tf.reshape(found[0].stack(), [-1, depth])[:rows] * upstream[:, None]
                d_kernel, d_bias = found[1] * upstream[first], found[2] * upstream[first]
            else:
                def backward(index, d_hidden, d_kernel, d_bias):
                    rows_ids, live, part, tile = chunk(index, weights, shift)
                    softmax = tf.exp(tile - tf.gather(lse, rows_ids)[:, None])
                    d_part, d_weights, d_shift = gradients(softmax, rows_ids, live, part, weights,
                                                           tf.gather(upstream, rows_ids))
                    return index + 1, d_hidden.write(index, d_part), d_kernel + d_weights, d_bias + d_shift

                d_hidden, d_kernel, d_bias = loop(backward, arrays(1, [size, depth]) + [
                    zeros_like_kernel(), tf.zeros([classes], tf.float32)])
                d_hidden = tf.reshape(d_hidden.stack(), [-1, depth])[:rows]
            out = [tf.cast(d_hidden, hidden_in.dtype), tf.cast(d_kernel, kernel_in.dtype)]
            return out if no_bias else out + [tf.cast(d_bias, bias_in[0].dtype)]

        return loss, grad

    return loss_of(hidden, kernel, *([] if no_bias else [bias]))
