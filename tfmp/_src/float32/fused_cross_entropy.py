"""Output projection and softmax cross-entropy fused: the logits are never whole, in float32 or 16 bits.

Given what the output projection multiplies (`tfmp._src.keras_hooks.projection_graph.Projection`:
hidden states ``[rows, depth]``, kernel, optional bias), the loss takes the vocabulary a block of
columns at a time (``chunk_bytes // (4 * rows)`` columns: one block of float32 logits over every
row), computes that block's logits as the layer outputs them (the matmul rounded to the layer's
compute dtype, then the bias added in it), and keeps per row a running maximum and sum of
exponentials (an online log-sum-exp) and the target's terms. The layer's full-size matmul then
has no consumer in the training step and TensorFlow prunes it; a metric reading the logits keeps
it (and still gets the layer's values). Blocks of columns rather than rows: each block multiplies
a slice of the kernel by every row (a large matmul) and yields its slice of the kernel's gradient
once, where a block of rows would multiply the whole kernel and add a kernel-sized gradient.
Each block is a contiguous slice of the kernel; the last one ends at the last class, and its
columns already in the block before are dead there (masked in that block only).

Gradients (``tf.custom_gradient``, for hidden, kernel and bias), a second pass over the blocks:
``g = softmax * sum(target) - target`` in float32, ``d_hidden += g @ block^T``, the block's
``d_kernel = hidden^T @ g`` and ``d_bias = sum(g)``, each row's upstream factor applied to the
hidden states (and ``d_hidden``) once rather than to every block. For one-hot targets the
``-target`` term is taken out of the blocks: ``-1`` at each row's label is a gather of kernel
columns for ``d_hidden`` and a scatter of hidden rows into ``d_kernel``, done once. When every
kept row's upstream gradient is the same (``uniform``: a Keras reduction without sample weights
weighs every kept row alike, `chunked_losses`), the second pass runs in the forward and its
results are scaled by the upstream gradient (as Liger-Kernel's fused linear cross-entropy does;
where no gradient is taken, as in ``evaluate``, TensorFlow prunes it); otherwise the backward
runs it with each row's upstream gradient. A float32 kernel or bias (a mixed policy's variable before the
layer's cast) gets its gradient in float32.

The block's matmul runs in float32 where the hardware has no fast 16-bit matmul (`float32_matmul`:
TensorFlow's 16-bit CPU matmul without oneDNN converts to float32 and back, so the result, rounded
once to the compute dtype as that kernel rounds it, `matmul_truncates`, is the same) and in the
compute dtype elsewhere.
Measurements: benchmarks/README.md, "Decoder loss".
"""

from __future__ import annotations

from typing import Optional, Tuple

import tensorflow as tf

from tfmp._src.keras_hooks.projection_graph import Projection

#: Default bytes of one float32 block of logits (all rows x some vocabulary columns): 8 MiB. Measured
#: (benchmarks/README.md, "Decoder loss", Zen 3, vocabulary 32k): at 32 MiB the block's float32
#: temporaries made the step's peak 0.60x plain Keras's; at 8 MiB 0.17-0.20x.
CHUNK_BYTES = 8 * 2**20


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


_truncation = {}


def matmul_truncates(dtype: tf.DType) -> bool:
    """True when this process's ``tf.matmul`` of ``dtype`` (bfloat16) rounds its float32 sums toward zero.

    A known answer, measured once per process: ``[1, 1] @ [1, 3 * 2**-9]`` is 1.005859375, which
    rounds to 1.0078125 to nearest and to 1.0 toward zero. TensorFlow 2.21's bfloat16 CPU matmul
    without oneDNN (Eigen) truncates (measured on Zen 3); its casts round to nearest even.
    """
    if dtype != tf.bfloat16:
        return False
    if dtype not in _truncation:
        with tf.init_scope():  # eager, outside any graph being traced
            one = tf.constant([[1.0, 1.0]], dtype)
            value = tf.matmul(one, tf.constant([[1.0], [3 * 2.0**-9]], dtype))
            _truncation[dtype] = float(tf.cast(value, tf.float32)[0, 0]) == 1.0
    return _truncation[dtype]


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
        label_smoothing, ignore_class: As `chunked_cross_entropy.sparse_cross_entropy`.
        chunk_bytes: Int. Bytes of one float32 block of logits: every row, ``chunk_bytes // (4 * rows)``
            vocabulary columns (at least 1).

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
    classes = classes_of(projection)
    dense = tf.reshape(tf.convert_to_tensor(labels), [-1, classes])
    return _fused(projection, None, dense, keep, uniform, float(label_smoothing), chunk_bytes)


def classes_of(projection: Projection) -> int:
    """Int. The classes (logits' last size) `projection` outputs."""
    return int(projection.kernel.shape[0 if projection.transpose else 1])


def _fused(projection: Projection, ids, dense, keep, uniform: bool, smoothing: float, chunk_bytes: int):
    """Float32 ``[rows]`` losses (0 outside ``keep``) of the logits ``projection`` outputs, by column blocks."""
    hidden, kernel, transpose, bias, dtype, bias_on_product = projection
    classes, depth = classes_of(projection), int(hidden.shape[-1])
    rows = tf.shape(hidden)[0]
    # columns per block: `chunk_bytes` of float32 logits over every row (under XLA a constant: from a shape)
    width = tf.clip_by_value(int(chunk_bytes) // (4 * tf.maximum(rows, 1)), 1, classes)
    blocks = (classes + width - 1) // width
    # Block i is the contiguous columns [start(i), start(i) + width): i * width, except the last, which
    # ends at `classes`; its first `overlap` columns, already in the block before, are dead there.
    overlap = blocks * width - classes
    offsets = tf.range(width)
    work = tf.float32 if float32_matmul(dtype) else dtype  # the matmuls' dtype
    kernel_axis = 0 if transpose else 1
    kept = tf.ones([rows], tf.float32) if keep is None else tf.cast(keep, tf.float32)

    def round_trip(value):  # a float32 tensor rounded to the compute dtype, as the layer's op outputs it
        return value if dtype == tf.float32 else tf.cast(tf.cast(value, dtype), tf.float32)

    cut = matmul_truncates(dtype) and work == tf.float32

    def matmul_output(value):  # a float32 product as TensorFlow's 16-bit matmul kernel outputs it
        if not cut:
            return round_trip(value)
        return tf.bitcast(tf.bitwise.bitwise_and(tf.bitcast(value, tf.int32), -65536), tf.float32)

    def start(index):
        return tf.minimum(index * width, classes - width)

    def columns(kernel_in, first):
        """The kernel's columns (rows, transposed) ``[first, first + width)``, contiguous."""
        return tf.slice(kernel_in, [first, 0], [width, depth]) if transpose else \
            tf.slice(kernel_in, [0, first], [depth, width])

    def block(index, part, kernel_in, bias_in):
        """Start, live columns (float 0/1), the kernel block and float32 logits ``[rows, width]`` of a block
        (``part``: the hidden states in the matmuls' dtype)."""
        first = start(index)
        live = tf.cast(first + offsets >= index * width, tf.float32)
        weights = tf.cast(tf.cast(columns(kernel_in, first), dtype), work)
        shift = None if bias_in is None else tf.cast(tf.cast(tf.slice(bias_in, [first], [width]), dtype), tf.float32)
        if shift is not None and bias_on_product and work != tf.float32:
            # as the layer's matmul with its bias fused in by TensorFlow's remapper: float32 sums, one rounding
            product = tf.matmul(tf.cast(part, tf.float32), tf.cast(weights, tf.float32), transpose_b=transpose)
            return first, live, weights, round_trip(product + shift)
        product = tf.matmul(part, weights, transpose_b=transpose)
        # the matmul's output rounded to the layer's dtype (by the matmul in it, else as its kernel rounds)
        logits = tf.cast(product, tf.float32) if work != tf.float32 else matmul_output(product)
        if shift is not None:  # a 16-bit add: the float32 sum, rounded. Not a BiasAdd on the 16-bit product,
            logits = round_trip(logits + shift)  # which the remapper may fuse into the matmul (one rounding)
        return first, live, weights, logits

    def target(first, live):
        """The float32 target of a block ``[rows, width]``, 0 in dead columns."""
        cols = first + offsets
        if dense is None:
            one_hot = tf.cast(tf.equal(ids[:, None], cols[None, :]), tf.float32) * live
            return (1.0 - smoothing) * one_hot + smoothing / classes * live if smoothing else one_hot
        t = tf.cast(tf.slice(dense, [0, first], [rows, width]), tf.float32)
        return (t * (1.0 - smoothing) + smoothing / classes if smoothing else t) * live

    def where_dead(index, masked, value):
        """``masked()`` in the block with dead columns (the last, when ``overlap > 0``), else ``value``."""
        return tf.cond(tf.logical_and(overlap > 0, index == blocks - 1), masked, lambda: value)

    hard = dense is None and not smoothing  # one-hot targets: read at the label; their gradient term outside the loop

    def loop(body, state):
        return tf.while_loop(lambda i, *_: i < blocks, body, (0, *state), maximum_iterations=blocks,
                             parallel_iterations=1)[1:]

    def log_sum_exp(hidden_in, kernel_in, bias_in):
        """Pass 1: float32 ``(lse, sum(t), sum(t * x))`` per row, an online log-sum-exp over the blocks."""
        part = tf.cast(hidden_in, work)

        def body(index, peak, total_exp, total, weighted):
            first, live, _, logits = block(index, part, kernel_in, bias_in)
            logits = where_dead(index, lambda: logits + (live - 1.0) * 3e38, logits)  # far below every live one
            new_peak = tf.maximum(peak, tf.stop_gradient(tf.reduce_max(logits, axis=1)))
            total_exp = total_exp * tf.exp(peak - new_peak) + tf.reduce_sum(tf.exp(logits - new_peak[:, None]), 1)
            if hard:  # the label's logit, where the label is a live column of this block
                inside = tf.logical_and(ids >= index * width, ids < first + width)
                where = tf.stack([tf.range(rows), tf.clip_by_value(ids - first, 0, width - 1)], axis=1)
                return index + 1, new_peak, total_exp, total, weighted + tf.where(
                    inside, tf.gather_nd(logits, where), 0.0)
            t = target(first, live)
            logits = where_dead(index, lambda: logits * live, logits)  # no 3e38 * 0 below
            return index + 1, new_peak, total_exp, total + tf.reduce_sum(t, 1), weighted + tf.reduce_sum(t * logits, 1)

        zeros = tf.zeros([rows], tf.float32)
        peak, total_exp, total, weighted = loop(body, (zeros - 3e38, zeros, zeros + 1.0 if hard else zeros, zeros))
        return tf.math.log(total_exp) + peak, total, weighted

    def assembled(blocks_stack, axis):
        """The ``classes`` columns along ``axis`` of per-block gradients laid end to end: the last block's
        first ``overlap`` (dead) columns left out."""
        end = (blocks - 1) * width
        size = tf.shape(blocks_stack)[axis]
        if axis == 0:
            return tf.concat([blocks_stack[:end], blocks_stack[end + overlap:size]], axis=0)
        return tf.concat([blocks_stack[:, :end], blocks_stack[:, end + overlap:size]], axis=1)

    def gradients(hidden_in, kernel_in, bias_in, lse, total, scale):
        """Pass 2: float32 ``d_hidden``, ``d_kernel`` and ``d_bias`` for ``g = (softmax * sum(t) - t) * scale``.

        The loop takes ``g / scale`` (one row factor): ``scale`` multiplies the hidden states once for the
        kernel's gradient, ``d_hidden`` once after the loop, and ``d_bias`` is ``scale @ g``. One-hot
        targets: the loop takes ``softmax``; the target's term (``-scale`` at each row's label) is added
        after it, a gather and a scatter instead of a pass over every block."""
        part = tf.cast(hidden_in, work)
        rows_scaled = tf.cast(part, tf.float32) * scale[:, None]  # [rows, depth]
        scaled = tf.cast(rows_scaled, work)

        def body(index, d_hidden, d_kernel, d_bias):
            first, live, weights, logits = block(index, part, kernel_in, bias_in)
            g = tf.exp(logits - lse[:, None])
            g = where_dead(index, lambda: g * live, g)
            if not hard:  # hard: sum(target) is 1, the target's term after the loop
                g = g * total[:, None] - target(first, live)
            low = tf.cast(g, work)
            d_hidden += tf.cast(tf.matmul(low, weights, transpose_b=not transpose), tf.float32)
            d_weights = tf.matmul(low, scaled, transpose_a=True) if transpose else \
                tf.matmul(scaled, low, transpose_a=True)
            return index + 1, d_hidden, d_kernel.write(index, tf.cast(d_weights, tf.float32)), d_bias.write(
                index, tf.linalg.matvec(g, scale, transpose_a=True))

        shape = [None, depth] if transpose else [depth, None]
        d_hidden, d_kernel, d_bias = loop(body, (tf.zeros([rows, depth], tf.float32),
                                                 tf.TensorArray(tf.float32, size=blocks, element_shape=shape),
                                                 tf.TensorArray(tf.float32, size=blocks, element_shape=[None])))
        d_kernel = d_kernel.stack()  # [blocks, width, depth] or [blocks, depth, width]
        if transpose:
            d_kernel = assembled(tf.reshape(d_kernel, [-1, depth]), 0)
        else:
            d_kernel = assembled(tf.reshape(tf.transpose(d_kernel, [1, 0, 2]), [depth, -1]), 1)
        d_bias = assembled(tf.reshape(d_bias.stack(), [-1]), 0)
        if hard:  # the one-hot term: -scale at each row's label (scattered into the gradients, no kernel-sized copy)
            label_rows = tf.cast(tf.cast(tf.gather(kernel_in, ids, axis=kernel_axis), dtype), tf.float32)
            d_hidden -= label_rows if transpose else tf.transpose(label_rows)
            if transpose:
                d_kernel = tf.tensor_scatter_nd_sub(d_kernel, ids[:, None], rows_scaled)
            else:  # kernel [depth, classes]: element (d, ids[r]) -= rows_scaled[r, d]
                at = tf.stack([tf.broadcast_to(tf.range(depth)[:, None], [depth, rows]),
                               tf.broadcast_to(ids[None, :], [depth, rows])], axis=-1)
                d_kernel = tf.tensor_scatter_nd_sub(d_kernel, at, tf.transpose(rows_scaled))
            d_bias = tf.tensor_scatter_nd_sub(d_bias, ids[:, None], scale)
        return d_hidden * scale[:, None], d_kernel, d_bias

    no_bias = bias is None

    @tf.custom_gradient
    def loss_of(hidden_in, kernel_in, *bias_in):
        shift = None if no_bias else bias_in[0]
        lse, total, weighted = log_sum_exp(hidden_in, kernel_in, shift)
        loss = (lse * total - weighted) * kept  # -sum(t * (x - lse)); 0 outside `keep`
        if uniform:  # every kept row's upstream gradient alike: the gradients now, scaled later
            found = gradients(hidden_in, kernel_in, shift, lse, total, kept)

        def grad(upstream):
            upstream = tf.cast(upstream, tf.float32)
            if uniform:  # scaled by the upstream gradient of the first kept row (all kept rows': the same)
                first = 0 if keep is None else tf.argmax(tf.cast(keep, tf.int32), output_type=tf.int32)
                alike = tf.gather(upstream, first)  # not upstream[first]: XLA would take `first` as a constant
                d_hidden, d_kernel, d_bias = found[0] * upstream[:, None], found[1] * alike, found[2] * alike
            else:
                d_hidden, d_kernel, d_bias = gradients(hidden_in, kernel_in, shift, lse, total, upstream * kept)
            out = [tf.cast(d_hidden, hidden_in.dtype), tf.cast(d_kernel, kernel_in.dtype)]
            return out if no_bias else out + [tf.cast(d_bias, bias_in[0].dtype)]

        return loss, grad

    return loss_of(hidden, kernel, *([] if no_bias else [bias]))
