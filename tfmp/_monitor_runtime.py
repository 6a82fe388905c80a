"""Where `tfmp.LossScaleMonitor` runs: device memory and crashes.

- Device memory comes from `tf.config.experimental.get_memory_info`, which
  TensorFlow fills in for GPUs only (on a CPU it returns zeros).
- Keras 3 has no callback hook for an exception in `fit`. The crash guard wraps
  `model.train_function` (the function `fit` calls once per execution of
  `steps_per_execution` steps, where a failing step, a failing input pipeline, a
  `tfmp.NonFiniteError` from stuck detection and Ctrl-C surface) and lets the
  monitors of that model write what training did up to the error before it
  propagates unchanged.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Tuple

import tensorflow as tf

#: Errors that end an epoch, not training: Keras's epoch iterator catches them.
_END_OF_DATA = (StopIteration, tf.errors.OutOfRangeError)
#: Monitors to tell about a crash, per model.
_ACTIVE: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def device_memory() -> Dict[str, Tuple[int, int]]:
    """Memory in use and its peak on each visible GPU, in bytes.

    Returns:
        Dict from device name (``"GPU:0"``) to (current bytes, peak bytes); empty
        when no GPU is visible or TensorFlow reports none (CPU-only machines).
    """
    result = {}
    for device in tf.config.list_logical_devices("GPU"):
        name = device.name.split("device:")[-1]
        try:
            info = tf.config.experimental.get_memory_info(name)
        except ValueError:  # raised for devices without an allocator that reports
            continue
        result[name] = (int(info["current"]), int(info["peak"]))
    return result


def watch_train_function(model: Any, monitor: Any) -> None:
    """Registers `monitor` for crash reports and guards `model.train_function`.

    On an exception other than end-of-data, the guard calls
    `monitor._on_crash(error)` for every registered monitor of `model`, then
    re-raises the exception unchanged. Call again after the first step (tfmp's
    stuck check wraps the train function while it is traced), so the outermost
    wrapper is a guard; a guard already outermost is kept.

    Args:
        model: `keras.Model` whose `fit` is running (after `make_train_function`).
        monitor: Object with an `_on_crash(error)` method.
    """
    monitors = _ACTIVE.setdefault(model, [])
    if not any(m is monitor for m in monitors):
        monitors.append(monitor)
    train_function = getattr(model, "train_function", None)
    if train_function is None or getattr(train_function, "_tfmp_crash_guard", False):
        return

    def guarded_train_function(*args: Any, **kwargs: Any) -> Any:
        try:
            return train_function(*args, **kwargs)
        except _END_OF_DATA:
            raise
        except BaseException as error:
            for watcher in list(_ACTIVE.get(model, ())):
                watcher._on_crash(error)
            raise

    guarded_train_function._tfmp_crash_guard = True
    model.train_function = guarded_train_function


def is_guarded(model: Any) -> bool:
    """Bool. Whether the outermost `model.train_function` is a crash guard."""
    return getattr(getattr(model, "train_function", None), "_tfmp_crash_guard", False)


def unwatch(model: Any, monitor: Any) -> None:
    """Stops telling `monitor` about crashes of `model` (the guard stays, inert)."""
    monitors = _ACTIVE.get(model, [])
    monitors[:] = [m for m in monitors if m is not monitor]
