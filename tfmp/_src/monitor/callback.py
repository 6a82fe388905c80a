"""`tfmp.LossScaleMonitor`: exact, cheap, crash-safe TensorBoard view of loss scaling.

Events go to ``<log_dir>/train`` in a file of their own (`event_file`), under tags grouped
for TensorBoard's first screen (`tags`): ``metrics/``, ``optimizer/``, ``precision/`` and
``system/`` scalars, Text tags, and a custom-scalars layout (`layout`).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Optional, Sequence, Union

import keras

from tfmp._src import distribute as _distribute
from tfmp._src.errors import check_positive_int, invalid_argument, is_positive_int, warn
from tfmp._src.keras_hooks import fit_lifecycle, train_function
from tfmp._src.loss_scale.optimizer import OVERFLOW_HISTORY, LossScaleOptimizer
from tfmp._src.monitor import metrics as _metrics, runtime, tags
from tfmp._src.monitor.event_file import EventFile
from tfmp._src.monitor.grad_stats import GradientStats
from tfmp._src.monitor.layout import DESCRIPTIONS, build_layout, layout_summary
from tfmp._src.monitor.state import describe, read_overflow_events, read_state, samples_this_epoch, skip_cause

_LOG = logging.getLogger(__name__)
_MIB = 2.0**20


def _file_in_the_way(folder: str) -> Optional[str]:
    """The deepest existing path of `folder` or its parents when it is not a folder, else None.

    Local paths only: a URL (``gs://...``) is left to the writer.
    """
    if "://" in folder:
        return None
    path = os.path.abspath(folder)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


#: Counters at the start of a logging window.
_Window = collections.namedtuple("_Window", "step overflows samples clock")


class LossScaleMonitor(keras.callbacks.Callback):
    """Logs loss scaling, overflow events, throughput and the training loss to TensorBoard.

    Exact: counts come from the optimizer's variables (`tfmp.LossScaleOptimizer`), so
    nothing between two reads is lost, whatever `steps_per_execution`; each skipped
    step is itemized at its own step (the last 64 between two logging points), and
    variables are read only at logging points. Crash-safe: each logging point is
    flushed as written; when ``fit`` raises (a failing step, `tfmp.NonFiniteError`, a
    callback, Ctrl-C, a full disk) the monitor writes the state with a note naming the
    error and closes its file first. A failing write never stops training: one
    `tfmp.LoggingWarning` names the folder, the first lost step, the cause and the fix,
    and the monitor retries in a new event file. Under a distribution strategy only the
    chief writes. It also writes Keras's `logs` (``metrics/...``) and, when the scale
    cannot move, a Text-tab note saying why.

    In a custom loop (hooks called directly or through `keras.callbacks.CallbackList`),
    `on_train_begin` must come before the first step (other hooks before it raise
    `RuntimeError`); epoch calls are optional (without `on_epoch_begin`, `batch` counts
    from `on_train_begin`); `on_train_end` closes the file. The epoch axis continues over
    every run of one monitor (two `fit(epochs=2)`: epochs 0 to 3) unless a `fit` has
    ``initial_epoch=k`` > 0, which keeps Keras's numbers, as `History` does.

    Args:
        log_dir: String or path-like. Root folder of the run; events go to
            ``<log_dir>/train`` (shareable with `keras.callbacks.TensorBoard`).
        update_freq: ``"epoch"`` (default), ``"batch"``, or a positive int N:
            write ``batch_`` scalars every N batches. With `steps_per_execution`
            k > 1 they are written at the end of the execution that reaches a
            multiple of N. Epoch scalars are always written.
        grad_stats_freq: Positive int or None (default, off): compute gradient
            statistics and the update-to-weight ratio every N steps; each logging
            point writes the latest. The first `fit` with it retraces the train
            function once; later `fit` calls do not.

    Raises:
        ValueError: `log_dir` is not a path, or a file stands where
            ``<log_dir>/train`` or a folder above it must be, or `update_freq` or
            `grad_stats_freq` is not one of the above.

    Example:
        >>> monitor = LossScaleMonitor("logs/run1", update_freq=100)
        >>> # model.fit(ds, epochs=3, callbacks=[monitor])
    """

    def __init__(
        self,
        log_dir: Union[str, os.PathLike],
        update_freq: Union[str, int] = "epoch",
        *,
        grad_stats_freq: Optional[int] = None,
    ) -> None:
        super().__init__()
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise invalid_argument(
                "log_dir", log_dir, "a non-empty folder path (str or path-like)",
                fix="Pass e.g. LossScaleMonitor('logs/run1').",
            )
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and not is_positive_int(update_freq):
            raise invalid_argument(
                "update_freq", update_freq, "'epoch', 'batch' or a positive int", choices=("epoch", "batch"),
                fix="Pass update_freq='epoch' (the default), 'batch', or a step count, e.g. update_freq=100.",
            )
        check_positive_int(
            "grad_stats_freq", grad_stats_freq, allow_none=True,
            fix="Pass None (off) or e.g. grad_stats_freq=100 for statistics every 100 steps.",
        )
        self.update_freq = update_freq
        self.grad_stats_freq = grad_stats_freq
        self.log_dir = os.fspath(log_dir)
        blocker = _file_in_the_way(self.train_log_dir)
        if blocker is not None:
            raise invalid_argument(
                "log_dir", self.log_dir, f"a folder in which {self.train_log_dir!r} can be created",
                fix=f"{blocker!r} is a file, not a folder: remove or rename it, or pass another log_dir.",
            )
        self._events = EventFile(self.train_log_dir, DESCRIPTIONS)
        self._active = False
        self._layout_written = False
        self._memory_noted = False
        self._float16 = False  # the model computes in float16 (set by on_train_begin)
        self._grad_stats: Optional[GradientStats] = None
        self._training = False  # between on_train_begin and on_train_end (or a crash)
        self._next_epoch = 0  # the epoch axis after the epochs logged so far, over every fit
        self._epoch_offset: Optional[int] = None  # added to Keras's epoch index in this fit
        fit_lifecycle.needs(self)

    @property
    def train_log_dir(self) -> str:
        """String. Folder the event files are written to."""
        return os.path.join(self.log_dir, "train")

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Starts a training run (`fit`, or a custom loop before its first step): reads the optimizer's state.

        Raises:
            ValueError: (template) no model was set: call `set_model(model)` or
                make the `CallbackList` with ``model=model`` first.
        """
        self._finish()  # a fit this monitor was in ended without on_train_end: start clean
        model = getattr(self, "_model", None)
        if model is None:
            raise ValueError(
                "LossScaleMonitor.on_train_begin() needs the model it monitors. Expected a "
                "keras.Model set on the monitor. Received: no model (set_model was never "
                "called). Call monitor.set_model(model), or make the list with "
                "keras.callbacks.CallbackList([monitor], model=model); model.fit does it itself."
            )
        self._training = True
        self._epoch_offset = None
        self._active = _distribute.is_chief(model.distribute_strategy)
        if not self._active:
            return
        state = read_state(model.optimizer)
        now = time.perf_counter()
        self._step = state.step  # batches trained, estimated between reads
        self._epoch_base = state.step  # batch indices count from here until an epoch begins
        self._itemized = state.overflow_count
        self._last_grad_step = -1
        self._samples, self._epoch_samples_read = 0, 0
        self._batch_window = _Window(state.step, state.overflow_count, 0, now)
        self._epoch_window = self._batch_window
        self._train_clock: Optional[float] = None
        self._has_gpu = bool(runtime.device_memory())
        self._float16 = model.dtype_policy.compute_dtype == "float16"  # float16 diagnostics only then
        self._counts_overflows = isinstance(model.optimizer, LossScaleOptimizer)
        if not self._counts_overflows:
            self._warn_no_counters(state.step)
        note = _metrics.flat_scale_note(model.optimizer, model.dtype_policy.compute_dtype)
        self._fixed_scale = _metrics.fixed_scale_reason(model.optimizer, model.dtype_policy.name)
        if note is not None:
            self._events.write(state.step, texts={_metrics.NOTE_TAG: note})
        if self.grad_stats_freq:
            self._grad_stats = GradientStats.of(model.optimizer, self.grad_stats_freq, model.distribute_strategy)
        if self._grad_stats is not None and self._grad_stats.resume(state.step):
            model.make_train_function(force=True)  # traced once with the statistics
        # Keras 3 has no callback for an exception in fit: these call _on_crash when the train
        # function raises, or anything else in fit does (a callback, Ctrl-C between steps).
        train_function.add_error_handler(model, self, self._on_crash)
        fit_lifecycle.on_fit_error(model, self, self._on_crash)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Starts epoch `epoch` (Int, Keras's index); optional in a custom loop.

        Raises:
            RuntimeError: (template) called before `on_train_begin`.
        """
        self._require_training("on_epoch_begin")
        if not self._active:
            return
        self._epoch_step(epoch)
        self._epoch_base = self._step
        self._epoch_samples_read = 0  # fit reset the metrics, loss tracker included
        self._train_clock = None
        self._epoch_window = self._epoch_window._replace(samples=self._samples, clock=time.perf_counter())

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        """After batch `batch` (Int, zero-based, from the epoch's start, or from `on_train_begin`).

        Raises:
            RuntimeError: (template) called before `on_train_begin`.
        """
        self._require_training("on_train_batch_end")
        if not self._active:
            return
        # With steps_per_execution > 1: once per execution, `batch` the index of its last step.
        previous, self._step = self._step, self._epoch_base + batch + 1
        freq = self.update_freq
        if freq != "epoch" and self._step // freq > previous // freq:
            self._log("batch_", logs=logs)

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        # Validation inside fit: evaluate() resets the loss tracker next.
        if self._active and self._train_clock is None:
            self._count_samples()
            self._train_clock = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Writes the epoch's scalars at its step on the epoch axis (see `_epoch_step`).

        Raises:
            RuntimeError: (template) called before `on_train_begin`.
        """
        self._require_training("on_epoch_end")
        if self._active:
            self._log("epoch_", self._epoch_step(epoch), logs)

    def _require_training(self, call: str) -> None:
        """Raises `RuntimeError` when `call` comes with no `on_train_begin` since the last `on_train_end`."""
        if not self._training:
            raise RuntimeError(
                f"LossScaleMonitor.{call}() was called outside a training run. Expected "
                "on_train_begin() first, then batch and epoch calls, then on_train_end(). "
                f"Received: {call}() with no on_train_begin() since the monitor was made or "
                f"since the last on_train_end(). Call callbacks.on_train_begin() before the "
                f"first step of the loop (and again before each new run)."
            )

    def _epoch_step(self, epoch: int) -> int:
        """Int. Where Keras's `epoch` lies on the monitor's epoch axis (see the class docstring)."""
        if self._epoch_offset is None:
            self._epoch_offset = self._next_epoch if epoch == 0 else 0
        return self._epoch_offset + epoch

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        self._finish()

    def _count_samples(self) -> None:
        seen = samples_this_epoch(self.model)
        if seen is not None and seen >= self._epoch_samples_read:
            self._samples += seen - self._epoch_samples_read
            self._epoch_samples_read = seen

    def _log(self, prefix: str, epoch: Optional[int] = None, logs: Optional[dict] = None) -> None:
        """Reads the state once and writes events, window scalars and `logs` at one step."""
        state = read_state(self.model.optimizer)
        self._step = state.step
        if epoch is not None and self._train_clock is not None:
            clock = self._train_clock  # validation ran: samples counted before it
        else:
            self._count_samples()
            clock = time.perf_counter()
        metrics = _metrics.metric_scalars(prefix, logs)
        names = [tag[len(tags.METRICS + prefix):] for tag in metrics]
        self._write_events(state, [name for name in names if not name.startswith("val_")])
        window = self._batch_window if epoch is None else self._epoch_window
        steps = state.step - window.step
        skipped = state.overflow_count - window.overflows
        scalars = {"loss_scale": state.loss_scale}  # by name; written under `tags.window`
        if self._counts_overflows:  # else nothing to report: write no made-up zeros
            scalars.update(overflow_count=state.overflow_count, skipped_steps=skipped,
                           overflow_rate=skipped / steps if steps > 0 else 0.0,
                           consecutive_overflows=state.consecutive_overflows)
        if state.learning_rate is not None:
            scalars["lr"] = state.learning_rate
        samples = self._samples - window.samples
        if samples > 0 and clock > window.clock:
            scalars["samples_per_second"] = samples / (clock - window.clock)
        memory = sorted(runtime.device_memory().items()) if self._has_gpu else []
        for index, (_, (current, peak)) in enumerate(memory):
            scalars[f"gpu{index}_memory_mib"] = current / _MIB
            scalars[f"gpu{index}_memory_peak_mib"] = peak / _MIB
        if not self._has_gpu and not self._memory_noted:
            self._note(
                state.step,
                "device memory is not available here: TensorFlow reports it for "
                "GPUs only (tf.config.experimental.get_memory_info), so there are "
                "no gpu*_memory_mib scalars.",
            )
            self._memory_noted = True
        for tag in metrics.keys() - self._events.descriptions.keys():
            self._events.descriptions[tag] = _metrics.describe_metric(tag)
        if epoch is not None:
            self._next_epoch = max(self._next_epoch, epoch + 1)
        self._events.write(
            state.step if epoch is None else epoch,
            {**metrics, **{tags.window(prefix, name): value for name, value in scalars.items()}},
            batch_step=state.step,
        )
        new_window = _Window(state.step, state.overflow_count, self._samples, clock)
        if epoch is None:
            self._batch_window = new_window
        else:
            self._epoch_window = new_window

    def _write_events(self, state, metric_names: Sequence[str] = ()) -> None:
        """Writes skipped steps and gradient statistics not yet written (the layout at the first call)."""
        if not self._layout_written:
            prefixes = ("epoch_",) if self.update_freq == "epoch" else ("batch_", "epoch_")
            layout = build_layout(prefixes, self._grad_stats is not None, metric_names,
                                  fixed_scale=self._fixed_scale, float16=self._float16)
            # Written again at the next logging point if the write failed.
            self._layout_written = self._events.write(
                0, summaries=[layout_summary(layout)], batch_step=state.step)
        # Lower only if the counters were restored to an earlier state.
        self._itemized = min(self._itemized, state.overflow_count)
        events, lost = read_overflow_events(self.model.optimizer, self._itemized, state.overflow_count)
        self._itemized = state.overflow_count
        if lost:
            self._note(
                state.step,
                f"{lost} earlier skipped steps since the last logging point are "
                f"counted but not itemized (the overflow history holds "
                f"{OVERFLOW_HISTORY}); log more often to see each.",
            )
        cause = skip_cause(self.model.optimizer) if events else None
        for event in events:
            self._events.write(
                event.step,
                {tags.event("overflow_scale"): event.scale_before},
                {"overflow_events": describe(event, cause)},
            )
        stats = self._grad_stats.read() if self._grad_stats is not None else None
        if stats is not None and stats[0] > self._last_grad_step:
            self._last_grad_step = stats[0]
            self._events.write(stats[0], {tags.event(name): value for name, value in stats[1].items()
                                          if self._float16 or name not in tags.FLOAT16_ONLY})

    def _warn_no_counters(self, step: int) -> None:
        """Says that the optimizer counts no overflows: a note, and a warning in 16 bits (likely a mistake)."""
        text = (
            f"the optimizer ({type(self.model.optimizer).__name__}) keeps no overflow "
            "counts, so only loss_scale (1.0 without loss scaling) and lr are written."
        )
        if self.model.dtype_policy.compute_dtype == "float32":
            self._note(step, text + " tfmp leaves a float32 model's optimizer alone; pass "
                       "tfmp.enable(loss_scale_options={...}) or debug=True to count non-finite steps.")
            return
        fix = "Call tfmp.enable() before compile, or wrap the optimizer in tfmp.LossScaleOptimizer."
        warn(f"LossScaleMonitor: the optimizer ({type(self.model.optimizer).__name__}) keeps no overflow counts.",
             f"Only loss_scale and lr are written, while model {self.model.name!r} computes in "
             f"{self.model.dtype_policy.compute_dtype}, where skipped steps are likely.", f"Fix: {fix[0].lower()}{fix[1:]}",
             UserWarning, section="tensorboard-logs")
        self._note(step, f"{text} {fix}")

    def _note(self, step: int, text: str) -> None:
        """Writes a ``monitor_notes`` line; notes use the step axis of batches."""
        self._events.write(step, texts={"monitor_notes": f"step {step}: {text}"})

    def _on_crash(self, error: BaseException) -> None:
        """Called by the crash guard: writes what training did up to `error`."""
        if not self._active:
            return
        try:
            state = read_state(self.model.optimizer)
            if self.update_freq != "epoch" and state.step > self._batch_window.step:
                self._log("batch_")
            else:
                self._write_events(state)
            said = str(error)[:500]
            self._note(state.step, f"training stopped by {type(error).__name__}" + (f": {said}" if said else ""))
        except Exception as failure:  # the training error matters more; keep it
            _LOG.warning("tfmp.LossScaleMonitor could not log the crash: %r", failure)
        finally:
            self._finish()

    def _finish(self) -> None:
        self._training = False
        if self._active:
            self._active = False
            train_function.remove_error_handler(self.model, self)
            fit_lifecycle.forget(self.model, self)
            if self._grad_stats is not None:
                self._grad_stats.pause()  # stays traced in: the next fit does not retrace
        self.close()

    def close(self) -> None:
        """Flushes and closes the event file; a later write opens a new file."""
        self._events.close()
