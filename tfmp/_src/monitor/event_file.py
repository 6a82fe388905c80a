"""The TensorBoard event writer of `tfmp.LossScaleMonitor`, on `tf.summary`.

A thin layer over a `tf.summary` file writer that adds what the monitor needs:
the writer is created on the first write (no empty files from processes that
never log, e.g. non-chief workers), every `write` is flushed at once so that a
crash right after it loses nothing (the default writer keeps events queued for
up to two minutes), and each tag's description is attached.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import tensorflow as tf
from tensorboard.compat.proto import summary_pb2


class EventFile:
    """Writes TensorBoard events into one run directory, flushing every write.

    `tf.summary` names each writer's file uniquely
    (``events.out.tfevents.<seconds>.<host>.<pid>.<n>.v2``), so it never clobbers
    the files of other writers in the same directory, such as
    `keras.callbacks.TensorBoard`'s.

    Args:
        directory: String. Folder of the event file (a TensorBoard run); created if
            missing. Any path `tf.summary.create_file_writer` accepts.
        descriptions: Mapping from tag to a sentence TensorBoard shows under the
            chart (Markdown).
    """

    def __init__(
        self, directory: str, descriptions: Optional[Mapping[str, str]] = None
    ) -> None:
        self.directory = directory
        self.descriptions = dict(descriptions or {})
        self._writer: Optional[tf.summary.SummaryWriter] = None

    @property
    def is_open(self) -> bool:
        """Bool. Whether a writer is open (a write since the last `close`)."""
        return self._writer is not None

    def write(
        self,
        step: int,
        scalars: Optional[Mapping[str, float]] = None,
        texts: Optional[Mapping[str, str]] = None,
        summaries: Iterable[summary_pb2.Summary] = (),
    ) -> None:
        """Writes scalars, texts and ready-made summaries at `step`, then flushes.

        Args:
            step: Int. The TensorBoard step (x axis).
            scalars: Mapping from tag to a float (stored as float32).
            texts: Mapping from tag to a string (Markdown), shown by the Text tab.
            summaries: Further `Summary` protos, e.g. a custom-scalars layout.
        """
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.directory)
        with self._writer.as_default(step=int(step)):
            for tag, value in (scalars or {}).items():
                tf.summary.scalar(tag, value, description=self.descriptions.get(tag))
            for tag, text in (texts or {}).items():
                tf.summary.text(tag, text, description=self.descriptions.get(tag))
            for summary in summaries:
                tf.summary.experimental.write_raw_pb(summary.SerializeToString())
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the writer; the next `write` opens a new file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
