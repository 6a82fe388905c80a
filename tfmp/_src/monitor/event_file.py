"""The TensorBoard event writer of `tfmp.LossScaleMonitor`, on `tf.summary`.

Adds what the monitor needs: the writer is created at the first write (no empty files
from processes that never log), each write is flushed at once (a crash loses nothing),
tags carry their descriptions, and a failing write never reaches training (`EventFile`).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import socket
import time
from typing import Iterable, Mapping, Optional

import numpy as np
import tensorflow as tf
from tensorboard.compat.proto import summary_pb2

from tfmp._src.errors import warn

_LOG = logging.getLogger(__name__)
#: Seconds between two attempts to open a new event file after a failed write (closing
#: always tries once more): on a full disk each attempt may leave an empty file behind.
RETRY_SECONDS = 30.0
#: What a failing file system raises: Python's own I/O, or TensorFlow's ops.
WRITE_ERRORS = (OSError, tf.errors.OpError)
#: Who writes, as the warnings name it, and the Text tag of the note about lost events.
_OWNER, _NOTE_TAG = "tfmp.LossScaleMonitor", "monitor_notes"


class LoggingWarning(UserWarning):
    """tfmp could not write its TensorBoard events, or they would mix with another run's.

    Issued by `tfmp.LossScaleMonitor` once per failure (naming the folder, the first lost
    step, the cause and the fix), and once per event file when another process writes into
    the same folder. ``warnings.simplefilter("error", tfmp.LoggingWarning)`` stops such a run.
    """


#: An event file another process wrote to within this many seconds counts as
#: being written now (a run logging every epoch writes at least this often).
CONCURRENT_SECONDS = 300.0
#: ``events.out.tfevents.<seconds>.<host>.<pid>.<n>.v2``, as `tf.summary` names its files.
_EVENT_FILE = re.compile(r"^events\.out\.tfevents\.\d+\.(?P<host>.+)\.(?P<pid>\d+)\.\d+\.v2$")


def other_writers(directory: str) -> list:
    """``(file name, host, pid, age in s)`` of each event file of `directory` another process
    wrote to in the last `CONCURRENT_SECONDS`, newest first."""
    now = time.time()
    own = (socket.gethostname(), os.getpid())
    found = []
    try:
        names = os.listdir(directory)
    except OSError:  # not created yet, or unreadable: nothing to compare with
        return []
    for name in names:
        match = _EVENT_FILE.match(name)
        if match is None or (match["host"], int(match["pid"])) == own:
            continue
        try:
            age = now - os.path.getmtime(os.path.join(directory, name))
        except OSError:
            continue
        if age <= CONCURRENT_SECONDS:
            found.append((name, match["host"], int(match["pid"]), age))
    return sorted(found, key=lambda entry: entry[3])


def _warn_if_shared(directory: str) -> None:
    """Warns (`LoggingWarning`) when another process is writing events into `directory`."""
    found = other_writers(directory)
    if not found:
        return
    _, host, pid, age = found[0]
    warn(f"{_OWNER} writes into '{directory}', where process {pid} on {host} wrote {age:.0f} s ago.",
         "TensorBoard shows all event files of a folder as one run, so the two runs' points interleave.",
         "Fix: give each run its own log_dir, e.g. log_dir=f\"logs/{time.strftime('%Y%m%d-%H%M%S')}\".",
         LoggingWarning, section="tensorboard-logs")


@dataclasses.dataclass
class _Failure:
    """A failed write not yet followed by a successful one: first lost step, cause, last attempt."""

    first_step: int
    cause: str  # "ResourceExhaustedError: No space left on device"
    tried: float  # time.monotonic()


def describe_error(error: BaseException) -> str:
    """``"<class>: <message>"`` without TensorFlow's ``{{function_node ...}}`` prefix."""
    message = str(getattr(error, "message", None) or error)
    message = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", message)
    message = re.sub(r"\s*\[Op:\w+\]( name: \S*)?\s*$", "", message).strip()
    return f"{type(error).__name__}: {message[:300]}" if message else type(error).__name__


def _fix(directory: str, error: BaseException) -> str:
    """How to fix a write error, by its cause."""
    text = str(error).lower()
    code = getattr(error, "errno", None)
    if code == errno.ENOSPC or isinstance(error, tf.errors.ResourceExhaustedError) or "no space" in text:
        return f"free space on the disk of '{directory}', or pass another log_dir."
    if code == errno.ENOTDIR or "not a directory" in text:
        return (f"'{directory}' or a folder above it is a file: remove or rename that file, "
                "or pass another log_dir.")
    if isinstance(error, (PermissionError, tf.errors.PermissionDeniedError)):
        return f"make '{directory}' writable, or pass another log_dir."
    return f"check that '{directory}' is a writable folder with free space, or pass another log_dir."


class EventFile:
    """Writes TensorBoard events into `directory` (created if missing), flushing every write.

    `descriptions` maps a tag to the Markdown TensorBoard shows under its chart. Never raises
    a write error (`WRITE_ERRORS`): the first failure gives one `LoggingWarning` and drops
    the writer (one whose flush failed may stay broken) and the events; at later writes, at
    most every `RETRY_SECONDS`, and at `close` it opens a new file whose first event is a
    ``monitor_notes`` note naming the lost steps. The file open at the failure may end in one
    partial record, which TensorBoard skips (`tf.data.TFRecordDataset` raises `DataLossError`).
    """

    def __init__(self, directory: str, descriptions: Optional[Mapping[str, str]] = None) -> None:
        self.directory = directory
        self.descriptions = dict(descriptions or {})
        self._writer: Optional[tf.summary.SummaryWriter] = None
        self._failure: Optional[_Failure] = None
        self._last_step = 0
        self._checked_shared = False

    @property
    def is_open(self) -> bool:
        """Bool. Whether a writer is open (a write since the last `close`)."""
        return self._writer is not None

    @property
    def failing(self) -> bool:
        """Bool. Whether the last write failed (events are being lost)."""
        return self._failure is not None

    def write(self, step: int, scalars: Optional[Mapping[str, float]] = None,
              texts: Optional[Mapping[str, str]] = None, summaries: Iterable[summary_pb2.Summary] = (), *,
              batch_step: Optional[int] = None) -> bool:
        """Writes scalars (as float32), texts (Markdown) and `Summary` protos at `step`, then flushes.

        `batch_step` (default `step`) is the training step that warnings and notes about lost
        events name. Returns True when written and flushed, False when the events were lost.
        """
        at = step if batch_step is None else batch_step
        self._last_step = at
        if self._failure is not None:
            if time.monotonic() - self._failure.tried < RETRY_SECONDS or not self._recover(at):
                return False
        try:
            self._write(step, scalars, texts, summaries)
        except WRITE_ERRORS as error:
            self._fail(at, error)
            return False
        return True

    def _write(self, step, scalars, texts, summaries) -> None:
        if self._writer is None:
            if not self._checked_shared:  # once per EventFile
                self._checked_shared = True
                _warn_if_shared(self.directory)
            self._writer = tf.summary.create_file_writer(self.directory)
        # NumPy scalars: TensorFlow caches the tensor of every Python number it converts, for good.
        with self._writer.as_default(step=np.int64(step)):
            for tag, value in (scalars or {}).items():
                tf.summary.scalar(tag, np.float32(value), description=self.descriptions.get(tag))
            for tag, text in (texts or {}).items():
                tf.summary.text(tag, text, description=self.descriptions.get(tag))
            for summary in summaries:
                tf.summary.experimental.write_raw_pb(summary.SerializeToString())
        self._writer.flush()

    def _fail(self, step: int, error: BaseException) -> None:
        """Drops the writer after `error`; warns if this starts a failure."""
        self._drop_writer()
        if self._failure is not None:  # a retry failed: same loss, already warned
            self._failure.tried = time.monotonic()
            _LOG.info("%s: still cannot write to %r: %s", _OWNER, self.directory, describe_error(error))
            return
        self._failure = _Failure(step, describe_error(error), time.monotonic())
        warn(f"{_OWNER} could not write events to '{self.directory}' ({self._failure.cause}).",
             f"Events from step {step} on are lost until a write succeeds (retried at most every {RETRY_SECONDS:g} s); "
             "training goes on.", f"Fix: {_fix(self.directory, error)}",
             LoggingWarning, section="tensorboard-logs")

    def _recover(self, step: int, closing: bool = False) -> bool:
        """Opens a new writer and writes the note about the lost events; True on success."""
        failure = self._failure
        until = f"step {step}" if closing else f"before step {step}"
        note = (
            f"step {step}: events from step {failure.first_step} until {until} were not "
            f"written ({failure.cause}). The previous event file in this folder may end in "
            "a partial record, which TensorBoard skips."
        )
        try:
            self._write(step, None, {_NOTE_TAG: note}, ())
        except WRITE_ERRORS as error:
            self._fail(step, error)
            return False
        self._failure = None
        return True

    def _drop_writer(self) -> None:
        """Closes the writer, ignoring the errors of a broken one."""
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except WRITE_ERRORS as error:
                _LOG.info("%s: closing a failed writer: %s", _OWNER, describe_error(error))

    def close(self) -> None:
        """Flushes and closes the writer; the next `write` opens a new file.

        After a failure, first tries once more to write the note about the lost events. A
        failing close warns as a failing write does.
        """
        if self._failure is not None:
            self._recover(self._last_step, closing=True)
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except WRITE_ERRORS as error:  # events of the last write may be lost
                self._fail(self._last_step, error)
                self._recover(self._last_step, closing=True)
                self._drop_writer()
        self._failure = None  # the next training run starts afresh (and warns afresh)
