"""The model-level class hooks: on while a session is open or an attached model traces a step.

``Layer.losses``, ``tf.GradientTape.gradient``, Keras's backend ``add`` and ``dropout`` and the speed features'
(`SPEED`) act on attached objects only, deciding by `record.of`, never by the thread. `hold` keeps
them on while a session is open; otherwise they are on inside `in_step` (an attached layer's call or
traced step, `tfmp.step_scope`) and while a layer attached at its first call lives.
`release_if_unused` takes them off (never from a garbage-collection callback: lock order).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, Mapping, Optional

from tfmp._src.attachment import record
from tfmp._src.float32 import bias_gradient, conv, cross_entropy, dropout_draw, fused_batchnorm, gelu, gradient_errors
from tfmp._src.keras_hooks import layer_calls, surfaces
from tfmp._src.keras_hooks.loss_terms import install_losses_hook
from tfmp._src.policy import session, speedups

_hooks: Dict[str, List[surfaces.Hook]] = {}  # "losses" or an optional feature -> its hooks
_lock = threading.RLock()
_steps = 0  # `in_step` blocks open, in any thread
#: The optional ones, each installed on its own: one whose surface is missing is switched off (`availability`).
OPTIONAL = (("fused_batchnorm", fused_batchnorm.install), ("gradient_errors", gradient_errors.install),
            ("gelu", gelu.install), ("conv", conv.install), ("cross_entropy", cross_entropy.install),
            ("bias_gradient", bias_gradient.install),
            ("dropout", dropout_draw.install))
#: The speed features of `OPTIONAL`: installed only where a session's or attached model's ``speedups`` has them on.
SPEED = frozenset(feature for feature, _ in OPTIONAL if feature in speedups.FEATURES)


def speed_features(speedups: Optional[Mapping[str, bool]]) -> FrozenSet[str]:
    """The features of `SPEED` a ``speedups`` dict (feature -> wanted) leaves on; None: all."""
    return frozenset(name for name in SPEED if speedups is None or speedups[name])


def hold(speed_features: Iterable[str] = ()) -> None:
    """Installs the model-level hooks not on yet, of `SPEED` only those in `speed_features` (`OPTIONAL` may fail)."""
    wanted = set(speed_features)
    with _lock:
        if "losses" not in _hooks:
            _hooks["losses"] = surfaces.all_or_none([install_losses_hook])
        for feature, install in OPTIONAL:
            if feature not in _hooks and (feature not in SPEED or feature in wanted):
                _hooks[feature] = surfaces.optional(feature, install)


@contextlib.contextmanager
def in_step(speed_features: Iterable[str] = ()) -> Iterator[None]:
    """Keeps the model-level hooks on inside the block, of `SPEED` only those in `speed_features`.

    In `fit` they go on and off once per trace; without a session, at each outermost eager call.
    """
    global _steps
    with _lock:
        hold(speed_features)
        _steps += 1
    try:
        yield
    finally:
        with _lock:
            _steps -= 1
            last = not _steps
        if last:
            release_if_unused()


def hold_in_calls(layers: Iterable[Any], speed_features: Iterable[str] = ()) -> None:
    """Makes each of `layers` keep the model-level hooks on while its own ``call`` runs (as in its model's step)."""
    wrap = functools.partial(_call_in_step, frozenset(speed_features))
    for layer in layers:
        for hook in surfaces.subscriptions_on(layer):
            if hook.owner == "attachment" and hook.name == "call":
                hook.remove()
        layer_calls.subscribe(layer, "call", wrap, owner="attachment")


def _call_in_step(speed_features: FrozenSet[str], call: Callable) -> Callable:
    def attached_call(*args: Any, **kwargs: Any) -> Any:
        with in_step(speed_features):
            return call(*args, **kwargs)

    return attached_call


def release_if_unused() -> None:
    """Takes the model-level hooks off when no session, `in_step` block or first-call layer holds them."""
    with session.lock, _lock:  # session.lock first, as enable() takes them
        if _hooks and not session.any_open() and not _steps and not record.any_attached_at_first_call():
            for feature in reversed(list(_hooks)):
                hooks = _hooks[feature]
                while hooks:
                    hooks[-1].remove()  # kept in the list if removing raises
                    hooks.pop()
                del _hooks[feature]


def installed() -> List[surfaces.Hook]:
    """The model-level hooks now on (for the test suite's leak guard)."""
    with _lock:
        return [hook for hooks in _hooks.values() for hook in hooks]
