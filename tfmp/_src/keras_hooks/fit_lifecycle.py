"""One hook on Keras's ``fit``: what tfmp opened for a ``fit`` call closes however it ends.

Keras 3 has no callback for an exception out of ``fit`` (a raising callback, Ctrl-C): when ``fit``
raises, each handler registered for the model with `on_fit_error` sees the error, which then
propagates unchanged. On while an object that `needs` it lives (each `tfmp.LossScaleMonitor`, an
open session); a ``fit`` looked up before the hook came runs unhooked.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any, Callable, Dict, Optional

import keras

from tfmp._src.keras_hooks import patches, trainer
from tfmp._src.keras_hooks.patches import defining_class
from tfmp._src.keras_hooks.object_state import PerObject

_HANDLERS = PerObject("fit_error_handlers")  # model -> {key: handler}
_needed_by: "weakref.WeakSet[Any]" = weakref.WeakSet()
_hook: Optional[patches.Hook] = None
_lock = threading.RLock()
_LOG = logging.getLogger("tfmp")


def _wrap_fit(fit: Callable) -> Callable:
    @functools.wraps(fit)
    def tfmp_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fit(self, *args, **kwargs)
        except BaseException as error:
            handlers: Dict[Any, Callable] = _HANDLERS.pop(self, {})
            for handler in handlers.values():  # each one runs, whatever the others do
                try:
                    handler(error)
                except BaseException as failure:  # the error out of fit matters more
                    _LOG.warning("tfmp: a handler of the error out of fit failed: %r", failure)
            raise
        finally:
            try:
                release_if_unused()
            except Exception as failure:  # never hides fit's result or error
                _LOG.warning("tfmp: could not take the fit hook off: %r", failure)

    return tfmp_fit


def needs(owner: Any) -> None:
    """Installs the ``fit`` hook (if absent) and keeps it while `owner` is alive."""
    global _hook
    with _lock:
        _needed_by.add(owner)
        if _hook is None:
            trainer_class = defining_class(keras.Model, "fit")
            _hook = trainer.subscribe(trainer_class, "fit", _wrap_fit, owner="fit_lifecycle")


def not_needed_by(owner: Any) -> None:
    """`owner` no longer needs the hook (it may still be alive)."""
    with _lock:
        _needed_by.discard(owner)


def release_if_unused() -> None:
    """Takes the ``fit`` hook off when nothing that needs it is alive."""
    global _hook
    with _lock:
        if _hook is not None and not _needed_by:
            _hook.remove()
            _hook = None


def on_fit_error(model: Any, key: Any, handler: Callable[[BaseException], None]) -> None:
    """Calls `handler(error)` once if the running ``fit`` of `model` raises; one per `key`, its errors logged."""
    with _lock:
        _HANDLERS.setdefault(model, {})[key] = handler


def forget(model: Any, key: Any) -> None:
    """Drops the handler registered under `key` (``fit`` ended without an error)."""
    with _lock:
        handlers = _HANDLERS.get(model)
        if handlers is not None:
            handlers.pop(key, None)
            if not handlers:
                _HANDLERS.pop(model)
