"""`tfmp.ChunkedSparseCategoricalCrossentropy` and `tfmp.ChunkedCategoricalCrossentropy`: Keras losses
from 16-bit logits that never make a float32 tensor of the logits' size (`chunked_cross_entropy`).

Keras's ``Loss.__call__`` casts ``y_pred`` to the loss's float32 dtype before ``call``; these
losses compute their float32 per-example values from the logits as they come, then hand them
to ``Loss.__call__`` (with the Keras mask, ``ignore_class``'s rows left out), so sample
weights, masks, reductions and distribution scaling are Keras's own.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import keras
import tensorflow as tf

from tfmp._src.errors import check_positive_int, invalid_argument
from tfmp._src.float32 import chunked_cross_entropy as _chunked
from tfmp._src.float32 import fused_cross_entropy as _fused
from tfmp._src.keras_hooks.projection_graph import output_projection
from tfmp._src.keras_hooks.layer_calls import keras_mask, with_keras_mask

#: Largest ``chunk_bytes``: 1 GiB (a bigger chunk undoes what chunking is for).
MAX_CHUNK_BYTES = 2**30


def _checked(from_logits: Any, label_smoothing: Any, chunk_bytes: Any) -> float:
    """Raises the template ValueError for a wrong shared argument; returns ``label_smoothing`` as a float."""
    if from_logits is not True:
        raise invalid_argument("from_logits", from_logits, "True (a chunked cross-entropy takes logits)",
                               fix="Pass from_logits=True and logits (no softmax on the output layer); for "
                                   "probabilities use keras.losses.SparseCategoricalCrossentropy().")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or \
            not (math.isfinite(label_smoothing) and 0.0 <= label_smoothing <= 1.0):
        raise invalid_argument("label_smoothing", label_smoothing, "a number in [0, 1]",
                               fix="Pass e.g. label_smoothing=0.1, or 0.0 for none.")
    if chunk_bytes is not None:
        check_positive_int("chunk_bytes", chunk_bytes, maximum=MAX_CHUNK_BYTES, why="bytes of one float32 chunk",
                           fix=f"Pass e.g. chunk_bytes={_chunked.CHUNK_BYTES} (32 MiB), or None (the default).")
    return float(label_smoothing)


class _ChunkedLoss(keras.losses.Loss):
    """A Keras Loss computing float32 per-example values from logits of any float dtype, by chunks."""

    def __init__(self, from_logits: bool, label_smoothing: float, chunk_bytes: Optional[int], reduction: Optional[str],
                 name: str, dtype: Any, fuse_projection: bool) -> None:
        self.label_smoothing = _checked(from_logits, label_smoothing, chunk_bytes)
        if not isinstance(fuse_projection, bool):
            raise invalid_argument("fuse_projection", fuse_projection, "True or False",
                                   fix="Pass fuse_projection=True (the default) or False.")
        self.chunk_bytes = chunk_bytes
        self.fuse_projection = fuse_projection
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    @property
    def _rows_bytes(self) -> int:
        return _chunked.CHUNK_BYTES if self.chunk_bytes is None else self.chunk_bytes

    @property
    def _columns_bytes(self) -> int:
        return _fused.CHUNK_BYTES if self.chunk_bytes is None else self.chunk_bytes

    def per_example(self, y_true: Any, logits: tf.Tensor):
        """``(losses, valid)``: float32 losses of ``logits.shape[:-1]`` and the rows kept (None: all)."""
        raise NotImplementedError

    def per_row_fused(self, y_true: Any, projection: Any, keep: Optional[tf.Tensor], uniform: bool):
        """``(losses, valid)`` as `per_example`, flat ``[rows]``, from the output projection (`fused_cross_entropy`)."""
        raise NotImplementedError

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        logits = tf.convert_to_tensor(y_pred)
        if not logits.dtype.is_floating:
            logits = tf.cast(logits, self.dtype)
        mask = keras_mask(y_pred)
        projection = output_projection(logits) if self.fuse_projection else None
        with tf.name_scope(self.name):
            if projection is None:
                losses, valid = self.per_example(y_true, logits)
            else:  # a Keras reduction without sample weights weighs every kept row alike
                keep = None if mask is None else tf.reshape(tf.cast(mask, tf.bool), [-1])
                uniform = sample_weight is None and self.reduction not in (None, "none")
                losses, valid = self.per_row_fused(y_true, projection, keep, uniform)
                shape = tf.shape(logits)[:-1]
                losses, valid = tf.reshape(losses, shape), None if valid is None else tf.reshape(valid, shape)
        if valid is not None:
            mask = valid if mask is None else tf.logical_and(tf.cast(mask, tf.bool), valid)
        losses = with_keras_mask(losses, mask)
        return super().__call__(losses, losses, sample_weight)  # call() returns them as they are

    def call(self, y_true: Any, y_pred: Any) -> Any:
        """The per-example losses `__call__` computed, handed back to Keras's reduction."""
        return y_pred

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(from_logits=True, label_smoothing=self.label_smoothing, chunk_bytes=self.chunk_bytes,
                      fuse_projection=self.fuse_projection)
        return config


@keras.saving.register_keras_serializable(package="tfmp")
class ChunkedSparseCategoricalCrossentropy(_ChunkedLoss):
    """``keras.losses.SparseCategoricalCrossentropy(from_logits=True)`` from 16-bit logits, chunk by chunk.

    Equal to Keras's loss on the logits cast to float32 (within float32 rounding), without
    that cast: rows of logits are taken ``chunk_bytes // (4 * classes)`` at a time, in float32;
    the gradient recomputes each chunk's softmax from the saved logits and a float32
    log-sum-exp per row, and comes back in the logits' dtype. No float32 tensor of the logits'
    size is made (a 16-bit gradient of that size is). For a language model's output layer:
    keep it 16-bit (under `tfmp.enable`, ``compile`` does; plain Keras: no ``dtype="float32"``).

    Args:
        from_logits: Bool. Must be True (kept for Keras's signature and ``get_config``).
        ignore_class: Int or None. Label of tokens to leave out (padding): their loss is 0, their
            gradient 0, and with ``reduction="sum_over_batch_size"`` the mean is over the others,
            as Keras's ``ignore_class`` does it.
        label_smoothing: Float in ``[0, 1]``. Target ``(1 - s) * one_hot + s / classes``, as
            ``keras.losses.CategoricalCrossentropy(label_smoothing=s)`` on one-hot labels.
        reduction: As Keras's losses: ``"sum_over_batch_size"`` (default), ``"sum"``, ``"mean"``,
            ``"mean_with_sample_weight"``, ``"none"`` or None.
        name: String. The loss's name.
        dtype: The dtype of the loss value (default ``keras.config.floatx()``); the computation is float32.
        chunk_bytes: Int (bytes, at most 1 GiB) or None. Size of one float32 chunk of logits; None: 32 MiB
            of rows from whole logits, 8 MiB of columns when fused (`fuse_projection`).
        fuse_projection: Bool (default True). Under ``tf.function`` (Keras's ``fit``), where ``y_pred`` is
            the output of a Keras ``Dense`` or a projecting ``ReversibleEmbedding`` (bias optional), compute
            the logits from that layer's input and weights a block of vocabulary columns at a time, as the
            layer outputs them (its compute dtype), so that its full-size matmul is pruned and the logits
            are never whole (`tfmp._src.float32.fused_cross_entropy`); elsewhere (eager, other ops)
            the chunked loss on ``y_pred``.

    Inputs: ``y_true`` integer class ids ``[batch, ...]`` (a trailing 1 allowed), ``y_pred``
    logits ``[batch, ..., classes]`` of any float dtype, ``classes`` known.

    Raises:
        ValueError: (template) ``from_logits`` is not True, ``label_smoothing`` not in ``[0, 1]``,
            ``ignore_class`` neither None nor an int, ``chunk_bytes`` neither None nor an int in ``[1, 2**30]``,
            ``fuse_projection`` not a bool.

    Example:
        >>> import numpy as np, tensorflow as tf, tfmp
        >>> loss = tfmp.ChunkedSparseCategoricalCrossentropy()
        >>> logits = tf.constant([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]], tf.bfloat16)
        >>> round(float(loss(np.array([0, 2]), logits)), 4)
        0.6691
    """

    def __init__(self, from_logits: bool = True, ignore_class: Optional[int] = None, label_smoothing: float = 0.0,
                 reduction: Optional[str] = "sum_over_batch_size", name: str = "sparse_categorical_crossentropy",
                 dtype: Any = None, chunk_bytes: Optional[int] = None, fuse_projection: bool = True) -> None:
        if ignore_class is not None and (isinstance(ignore_class, bool) or not isinstance(ignore_class, int)):
            raise invalid_argument("ignore_class", ignore_class, "an int or None",
                                   fix="Pass the label of the tokens to leave out, e.g. ignore_class=0, or None.")
        self.ignore_class = ignore_class
        super().__init__(from_logits, label_smoothing, chunk_bytes, reduction, name, dtype, fuse_projection)

    def per_example(self, y_true: Any, logits: tf.Tensor):
        return _chunked.sparse_cross_entropy(y_true, logits, label_smoothing=self.label_smoothing,
                                             ignore_class=self.ignore_class, chunk_bytes=self._rows_bytes)

    def per_row_fused(self, y_true: Any, projection: Any, keep: Optional[tf.Tensor], uniform: bool):
        return _fused.sparse_cross_entropy(y_true, projection, keep, uniform=uniform,
                                           label_smoothing=self.label_smoothing, ignore_class=self.ignore_class,
                                           chunk_bytes=self._columns_bytes)

    def get_config(self) -> dict:
        return {**super().get_config(), "ignore_class": self.ignore_class}


@keras.saving.register_keras_serializable(package="tfmp")
class ChunkedCategoricalCrossentropy(_ChunkedLoss):
    """``keras.losses.CategoricalCrossentropy(from_logits=True)`` from 16-bit logits, chunk by chunk.

    As `tfmp.ChunkedSparseCategoricalCrossentropy`, for dense labels (one-hot or probabilities,
    ``y_true`` of the logits' shape, read a chunk at a time in float32).

    Args:
        from_logits: Bool. Must be True.
        label_smoothing: Float in ``[0, 1]``. Labels become ``y_true * (1 - s) + s / classes`` (Keras's rule).
        reduction: As Keras's losses (default ``"sum_over_batch_size"``).
        name: String. The loss's name.
        dtype: The dtype of the loss value (default ``keras.config.floatx()``); the computation is float32.
        chunk_bytes: Int (bytes, at most 1 GiB) or None, as in `tfmp.ChunkedSparseCategoricalCrossentropy`.
        fuse_projection: Bool (default True), as in `tfmp.ChunkedSparseCategoricalCrossentropy`.

    Raises:
        ValueError: (template) ``from_logits`` is not True, ``label_smoothing`` not in ``[0, 1]``,
            ``chunk_bytes`` neither None nor an int in ``[1, 2**30]``, ``fuse_projection`` not a bool.
    """

    def __init__(self, from_logits: bool = True, label_smoothing: float = 0.0,
                 reduction: Optional[str] = "sum_over_batch_size", name: str = "categorical_crossentropy",
                 dtype: Any = None, chunk_bytes: Optional[int] = None, fuse_projection: bool = True) -> None:
        super().__init__(from_logits, label_smoothing, chunk_bytes, reduction, name, dtype, fuse_projection)

    def per_example(self, y_true: Any, logits: tf.Tensor):
        return _chunked.cross_entropy(y_true, logits, label_smoothing=self.label_smoothing,
                                      chunk_bytes=self._rows_bytes), None

    def per_row_fused(self, y_true: Any, projection: Any, keep: Optional[tf.Tensor], uniform: bool):
        return _fused.cross_entropy(y_true, projection, keep, uniform=uniform, label_smoothing=self.label_smoothing,
                                    chunk_bytes=self._columns_bytes), None
