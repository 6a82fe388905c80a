"""The TensorBoard event writer of `tfmp.LossScaleMonitor`, on `tf.summary`.

A thin layer over a `tf.summary` file writer that adds what the monitor needs:
the writer is created on the first write (no empty files from processes that
never log, e.g. non-chief workers), every `write` is flushed at once so that a
crash right after it loses nothing (the default writer keeps events queued for
up to two minutes), and each tag's description is attached.

Steps and values are handed to TensorFlow as NumPy scalars, never as Python
numbers: TensorFlow keeps the tensor of every distinct Python int or float it
converts eagerly in a process-wide cache that is never trimmed (cleared only with
the eager context), about 0.7 KB each. Steps and logged values are new numbers at
nearly every logging point, so Python numbers made a monitor logging every batch
grow the process by about 0.2 MiB per 128-step `fit` call.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import numpy as np
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
        # NumPy scalars: see the module docstring (Python numbers are cached forever).
        with self._writer.as_default(step=np.int64(step)):
            for tag, value in (scalars or {}).items():
                tf.summary.scalar(tag, np.float32(value), description=self.descriptions.get(tag))
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
