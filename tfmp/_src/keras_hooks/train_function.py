"""One wrapper around each model's `train_function`, shared by every tfmp check.

``fit`` and ``train_on_batch`` call ``model.train_function`` once per execution. After each, on the
host, the named checks run in `CHECK_ORDER` (`tfmp.check_numerics`, the stuck check); on any error
but end of data the error handlers (the monitors) see it, then it propagates. A first call that fails
while traced drops the function, so the next ``fit`` makes a new one. Nothing here retraces the step.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional

import tensorflow as tf

from tfmp._src.keras_hooks import trainer
from tfmp._src.keras_hooks.step_scope import wraps

#: Order in which checks run after a step.
CHECK_ORDER = ("numerics", "stuck", "stuck.custom_optimizers")
#: Errors that end an epoch, not training: Keras's epoch iterator catches them.
END_OF_DATA = (StopIteration, tf.errors.OutOfRangeError)
_ATTR = "_tfmp_train_function"
_LOCK = threading.RLock()

Check = Callable[[Any], Any]


class _StepHooks:
    """The checks and error handlers of one model, and the wrapper that runs them."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.checks: Dict[str, Check] = {}
        self.handlers: Dict[Any, Callable[[BaseException], None]] = {}
        self.wrapper: Optional[Callable] = None
        self.inner: Optional[Callable] = None
        self.hook = trainer.subscribe(model, "make_train_function", self._wrap_make, owner="train_function")
        self._wrap_current()

    def _wrap_make(self, make: Callable) -> Callable:
        def make_train_function(force: bool = False) -> Any:
            result = make(force)
            self._wrap_current()
            return None if result is None else self.model.train_function

        return make_train_function

    def _wrap_current(self) -> None:
        """Wraps the model's train function unless this wrapper is in it (maybe under `step_scope`'s)."""
        current = getattr(self.model, "train_function", None)
        if current is None or wraps(current, self.wrapper):
            return
        self.inner = inner = current
        ran = False  # a call of `inner` has returned (its first call traces it)

        def train_function(*args: Any, **kwargs: Any) -> Any:
            nonlocal ran
            try:
                logs = inner(*args, **kwargs)
                ran = True
                for name in CHECK_ORDER:
                    check = self.checks.get(name)
                    if check is not None:
                        logs = check(logs)
                return logs
            except END_OF_DATA:
                raise
            except BaseException as error:
                if not ran:  # failed while TensorFlow traced it: the next fit makes a new one
                    self.model.train_function = None
                for handler in list(self.handlers.values()):
                    handler(error)
                raise

        train_function.tfmp_inner = inner
        self.wrapper = train_function
        self.model.train_function = train_function

    def remove_if_unused(self) -> None:
        if self.checks or self.handlers:
            return
        self.hook.remove()
        if getattr(self.model, "train_function", None) is self.wrapper:
            self.model.train_function = self.inner
        if vars(self.model).get(_ATTR) is self:
            object.__delattr__(self.model, _ATTR)


def _hooks(model: Any) -> _StepHooks:
    hooks = vars(model).get(_ATTR)
    if hooks is None:
        hooks = _StepHooks(model)
        object.__setattr__(model, _ATTR, hooks)
    else:
        hooks._wrap_current()
    return hooks


def _remove(model: Any, table: str, key: Any) -> None:
    """Drops `key` from the model's `checks` or `handlers`; unwraps when none is left."""
    with _LOCK:
        hooks = vars(model).get(_ATTR)
        if hooks is not None and getattr(hooks, table).pop(key, None) is not None:
            hooks.remove_if_unused()


def add_check(model: Any, name: str, check: Check) -> None:
    """Runs ``check(logs) -> logs`` (it may raise) after every train step of `model`, as `name` of `CHECK_ORDER`."""
    if name not in CHECK_ORDER:
        raise KeyError(f"Unknown train-step check {name!r}; known: {', '.join(CHECK_ORDER)}.")
    with _LOCK:
        _hooks(model).checks[name] = check


def remove_check(model: Any, name: str) -> None:
    """Stops running the check `name` on `model`; the other checks stay."""
    _remove(model, "checks", name)


def add_error_handler(model: Any, key: Any, handler: Callable[[BaseException], None]) -> None:
    """Calls `handler(error)` (must not raise) when a train step of `model` raises (not end of data); one per `key`."""
    with _LOCK:
        _hooks(model).handlers[key] = handler


def remove_error_handler(model: Any, key: Any) -> None:
    """Stops calling the error handler registered under `key`."""
    _remove(model, "handlers", key)


def remove_all(model: Any) -> None:
    """Drops every check and error handler of `model` and its wrapper: its train function is Keras's."""
    with _LOCK:
        hooks = vars(model).get(_ATTR)
        if hooks is not None:
            hooks.checks.clear()
            hooks.handlers.clear()
            hooks.remove_if_unused()


def has_check(model: Any, name: str) -> bool:
    """Bool. Whether the check `name` runs after `model`'s train steps."""
    hooks = vars(model).get(_ATTR)
    return hooks is not None and name in hooks.checks
