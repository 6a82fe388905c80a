"""`tfmp.LossScaleMonitor`: a Keras callback logging loss scaling to TensorBoard.

Scalars (written with `tf.summary` into ``<log_dir>/train``, the folder
`keras.callbacks.TensorBoard` uses for training events):

- ``loss_scale`` (``batch_loss_scale`` per batch, ``epoch_loss_scale`` per
  epoch): the optimizer's current loss scale; 1.0 when the optimizer does no
  loss scaling (mixed_bfloat16, float32).
- ``overflow_count`` (same prefixes): cumulative count of skipped steps whose
  gradients were non-finite; 0 for optimizers that do not count them.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import keras
import tensorflow as tf

from tfmp._distribute import is_chief
from tfmp._errors import invalid_argument


def read_loss_scale_state(optimizer) -> dict:
    """Reads loss-scaling state from an optimizer as Python numbers.

    Args:
        optimizer: A Keras optimizer; a `keras.optimizers.LossScaleOptimizer` (or
            `tfmp.LossScaleOptimizer`) gives its scale and counters.

    Returns:
        Dict with ``loss_scale`` (float) and ``overflow_count`` (int). An optimizer
        without loss scaling, or one not built yet, gives its starting values.
    """
    scale = 1.0
    overflows = 0
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if optimizer.built:
            scale = float(optimizer.dynamic_scale.numpy())
        else:
            scale = float(optimizer.initial_scale)
        counter = getattr(optimizer, "overflow_count", None)
        if counter is not None and optimizer.built:
            overflows = int(counter.numpy())
    return {"loss_scale": scale, "overflow_count": overflows}


class LossScaleMonitor(keras.callbacks.Callback):
    """Logs the loss scale and overflow count to TensorBoard event files.

    Args:
        log_dir: String or path-like. Root folder of the run; events go to
            ``<log_dir>/train`` (shareable with `keras.callbacks.TensorBoard`).
        update_freq: ``"epoch"`` (default), ``"batch"``, or a positive int N:
            write per-batch scalars every N batches. Epoch scalars are always
            written.

    Under a multi-worker `tf.distribute` strategy only the chief writes
    (`tfmp._distribute.is_chief`); the other workers log nothing.

    Raises:
        ValueError: `update_freq` is not "epoch", "batch" or a positive int.

    Example:
        >>> monitor = LossScaleMonitor("logs/run1", update_freq="batch")
        >>> # model.fit(ds, epochs=3, callbacks=[monitor])
    """

    def __init__(
        self, log_dir: Union[str, os.PathLike], update_freq: Union[str, int] = "epoch"
    ) -> None:
        super().__init__()
        if update_freq == "batch":
            update_freq = 1
        valid_int = isinstance(update_freq, int) and not isinstance(update_freq, bool)
        if update_freq != "epoch" and not (valid_int and update_freq > 0):
            raise invalid_argument(
                "update_freq", update_freq, "'epoch', 'batch' or a positive int",
                choices=("epoch", "batch"),
            )
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self._writer: Optional[tf.summary.SummaryWriter] = None
        self._step = 0  # batches trained so far, over all epochs
        self._epoch_start_step = 0

    @property
    def train_log_dir(self) -> str:
        """String. Folder the event files are written to."""
        return os.path.join(self.log_dir, "train")

    def _get_writer(self) -> tf.summary.SummaryWriter:
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.train_log_dir)
        return self._writer

    def _write(self, prefix: str, step: int) -> None:
        if not is_chief(self.model.distribute_strategy):  # one writer per cluster
            return
        state = read_loss_scale_state(self.model.optimizer)
        with self._get_writer().as_default(step=step):
            for tag, value in state.items():
                tf.summary.scalar(prefix + tag, value)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._epoch_start_step = self._step

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        # With steps_per_execution > 1 Keras calls this once per execution, with
        # `batch` the index of its last step.
        previous, self._step = self._step, self._epoch_start_step + batch + 1
        if self.update_freq != "epoch" and (
            self._step // self.update_freq > previous // self.update_freq
        ):
            self._write("batch_", self._step)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._write("epoch_", epoch)
        if self._writer is not None:
            self._writer.flush()

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        self.close()

    def close(self) -> None:
        """Flushes and closes the event writer; a later write opens a new file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
