"""Softmax cross-entropy from logits in float32, chunk by chunk over the rows, never whole in float32.

A language model's logits (batch x tokens x vocabulary) are its largest tensor: Keras's
from-logits cross-entropy takes them in float32 (the Keras mixed-precision guide's output
layer, or tfmp's logits cast), and TensorFlow's kernel returns a float32 gradient of the
same size. Here the logits stay in their own dtype (bfloat16, float16 or float32); rows are
taken `rows_per_chunk` at a time, cast to float32, and reduced to one float32 log-sum-exp
and one label term per row. The gradient (`tf.custom_gradient`) keeps only the logits and
that log-sum-exp and recomputes each chunk's softmax in float32, rounding it once to the
logits' dtype. Loops are `tf.while_loop`s of fixed-size chunks (the last one takes its rows
again from the end), so XLA compiles them. Measurements: benchmarks/README.md, "Decoder loss".
"""

from __future__ import annotations

from typing import Optional, Tuple

import tensorflow as tf

#: Default bytes of one float32 chunk of logits (rows x vocabulary x 4 bytes): 32 MiB.
CHUNK_BYTES = 32 * 2**20


def rows_per_chunk(classes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Int >= 1. Rows of ``classes`` float32 values (4 bytes each) that fit in ``chunk_bytes``."""
    return max(1, int(chunk_bytes) // (4 * int(classes)))


def sparse_cross_entropy(labels, logits, *, label_smoothing: float = 0.0, ignore_class: Optional[int] = None,
                         chunk_bytes: int = CHUNK_BYTES) -> Tuple[tf.Tensor, Optional[tf.Tensor]]:
    """Per-example softmax cross-entropy of integer labels, computed in float32 by chunks.

    Args:
        labels: Integer or float tensor of class ids, shape ``logits.shape[:-1]`` (or with a
            trailing 1). Must lie in ``[0, classes)`` except where equal to ``ignore_class``.
        logits: Float tensor ``[..., classes]`` of any float dtype; never cast whole.
        label_smoothing: Float in ``[0, 1]``. The target is ``(1 - s) * one_hot + s / classes``,
            as Keras's ``CategoricalCrossentropy(label_smoothing=s)`` on one-hot labels.
        ignore_class: Int or None. Rows whose label equals it have loss 0 and gradient 0.
        chunk_bytes: Int. Bytes of one float32 chunk of logits (`rows_per_chunk`).

    Returns:
        ``(loss, valid)``: float32 ``logits.shape[:-1]`` losses, and the boolean mask of the
        rows not ignored (None without ``ignore_class``).
    """
    logits = tf.convert_to_tensor(logits)
    classes = int(logits.shape[-1])
    ids = tf.reshape(tf.cast(labels, tf.int32), [-1])
    valid = None
    if ignore_class is not None:
        valid = tf.not_equal(ids, int(ignore_class))
        ids = tf.where(valid, ids, 0)
    flat = tf.reshape(logits, [-1, classes])
    loss = _chunked(flat, ids, None, valid, float(label_smoothing), rows_per_chunk(classes, chunk_bytes))
    shape = tf.shape(logits)[:-1]
    return tf.reshape(loss, shape), None if valid is None else tf.reshape(valid, shape)


def cross_entropy(labels, logits, *, label_smoothing: float = 0.0,
                  chunk_bytes: int = CHUNK_BYTES) -> tf.Tensor:
    """Per-example softmax cross-entropy of dense labels (one-hot or probabilities), in float32 by chunks.

    Args:
        labels: Float tensor of ``logits``'s shape; taken in float32, a chunk at a time.
        logits: Float tensor ``[..., classes]`` of any float dtype; never cast whole.
        label_smoothing: Float in ``[0, 1]``: labels become ``labels * (1 - s) + s / classes`` (Keras's rule).
        chunk_bytes: Int. Bytes of one float32 chunk of logits (`rows_per_chunk`).

    Returns:
        Float32 tensor ``logits.shape[:-1]``: ``-sum(labels * log_softmax(logits))`` per row.
    """
    logits = tf.convert_to_tensor(logits)
    classes = int(logits.shape[-1])
    flat = tf.reshape(logits, [-1, classes])
    dense = tf.reshape(tf.convert_to_tensor(labels), [-1, classes])
    loss = _chunked(flat, None, dense, None, float(label_smoothing), rows_per_chunk(classes, chunk_bytes))
    return tf.reshape(loss, tf.shape(logits)[:-1])


def label_terms(tile, rows_ids, ids, dense, smoothing: float):
    """``(sum(t), sum(t * x))`` per row of one float32 chunk ``x`` ``[size, classes]`` and its target ``t``
    (sparse: ``(1 - s) * one_hot + s / classes``, never made whole; dense: Keras's smoothed labels)."""
    classes = tile.shape[-1]
    if dense is None:
        picked = tf.gather(tile, tf.gather(ids, rows_ids), batch_dims=1)
        if smoothing:
            picked = (1.0 - smoothing) * picked + smoothing / classes * tf.reduce_sum(tile, axis=-1)
        return tf.ones_like(picked), picked
    target = _dense_target(rows_ids, dense, smoothing, classes)
    return tf.reduce_sum(target, axis=-1), tf.reduce_sum(target * tile, axis=-1)


def _dense_target(rows_ids, dense, smoothing: float, classes: int):
    target = tf.cast(tf.gather(dense, rows_ids), tf.float32)
    return target * (1.0 - smoothing) + smoothing / classes if smoothing else target


def row_terms(tile, rows_ids, ids, dense, smoothing: float, softmax: bool = False):
    """``(lse, loss)`` float32 ``[size]`` of one float32 chunk ``tile`` ``[size, classes]``: its log-sum-exp
    and ``-sum(t * (x - lse))`` for the target ``t`` of its rows (``rows_ids`` into ``ids`` or ``dense``);
    with ``softmax``, ``(lse, loss, softmax of tile)``."""
    peak = tf.stop_gradient(tf.reduce_max(tile, axis=-1, keepdims=True))
    exp = tf.exp(tile - peak)
    total_exp = tf.reduce_sum(exp, axis=-1)
    lse = tf.math.log(total_exp) + peak[:, 0]
    total, weighted = label_terms(tile, rows_ids, ids, dense, smoothing)
    if softmax:
        return lse, lse * total - weighted, exp * (1.0 / total_exp)[:, None]
    return lse, lse * total - weighted


def minus_target(softmax, rows_ids, ids, dense, smoothing: float):
    """``softmax * sum(t) - t`` of one chunk (the gradient of ``lse * sum(t) - sum(t * x)``)."""
    classes = softmax.shape[-1]
    if dense is not None:
        target = _dense_target(rows_ids, dense, smoothing, classes)
        return softmax * tf.reduce_sum(target, axis=-1, keepdims=True) - target
    labels = tf.gather(ids, rows_ids)
    where = tf.stack([tf.range(tf.shape(labels)[0]), labels], axis=1)
    spread = softmax - smoothing / classes if smoothing else softmax
    return tf.tensor_scatter_nd_sub(spread, where, tf.fill(tf.shape(labels), 1.0 - smoothing))


def chunk_plan(flat, size: int):
    """``(offsets, step, chunks, size)`` to take ``flat``'s rows (axis 0) ``size`` at a time: ``offsets``
    ``tf.range(step)``; ``size`` the static ``step`` or None (unknown rows: ``step`` is at most the rows,
    under XLA a compile-time constant as it comes from a shape)."""
    rows = tf.shape(flat)[0]
    if flat.shape[0] is not None:  # known rows: no chunk longer than the input
        size = max(1, min(size, int(flat.shape[0])))
        offsets = tf.range(size)
    else:
        offsets = tf.range(tf.minimum(size, tf.maximum(rows, 1)))
        size = None
    step = tf.shape(offsets)[0]
    return offsets, step, (rows + step - 1) // step, size


def _chunked(flat, ids, dense, valid, smoothing: float, size: int):
    """Float32 ``[rows]`` losses of ``flat`` ``[rows, classes]``; ``ids`` or ``dense`` gives the labels."""
    rows = tf.shape(flat)[0]
    offsets, step, chunks, size = chunk_plan(flat, size)
    dtype = flat.dtype

    def tiles(index):
        rows_ids = tf.minimum(index * step + offsets, rows - 1)  # past the end: the last row, cut off after
        return rows_ids, tf.cast(tf.gather(flat, rows_ids), tf.float32)

    @tf.custom_gradient
    def loss_of(logits):
        def body(index, out_lse, out_loss):
            rows_ids, tile = tiles(index)
            lse, loss = row_terms(tile, rows_ids, ids, dense, smoothing)
            return index + 1, out_lse.write(index, lse), out_loss.write(index, loss)

        arrays = [tf.TensorArray(tf.float32, size=chunks, element_shape=[size]) for _ in range(2)]
        _, lse_array, loss_array = tf.while_loop(lambda i, *_: i < chunks, body, (0, *arrays),
                                                 maximum_iterations=chunks, parallel_iterations=1)
        lse = tf.reshape(lse_array.stack(), [-1])[:rows]
        loss = tf.reshape(loss_array.stack(), [-1])[:rows]
        if valid is not None:
            loss = tf.where(valid, loss, 0.0)

        def grad(upstream):
            upstream = tf.cast(upstream, tf.float32)
            if valid is not None:
                upstream = tf.where(valid, upstream, 0.0)

            def back(index, out):
                rows_ids, tile = tiles(index)
                softmax = tf.exp(tile - tf.gather(lse, rows_ids)[:, None])
                scale = tf.gather(upstream, rows_ids)[:, None]
                chunk = minus_target(softmax, rows_ids, ids, dense, smoothing) * scale
                if valid is not None:
                    chunk = tf.where(tf.gather(valid, rows_ids)[:, None], chunk, 0.0)
                return index + 1, out.write(index, tf.cast(chunk, dtype))

            array = tf.TensorArray(dtype, size=chunks, element_shape=[size, flat.shape[-1]])
            _, array = tf.while_loop(lambda i, _: i < chunks, back, (0, array), maximum_iterations=chunks,
                                     parallel_iterations=1)  # one chunk's float32 tiles at a time
            return tf.reshape(array.stack(), [-1, flat.shape[-1]])[:rows]

        return loss, grad

    return loss_of(flat)
