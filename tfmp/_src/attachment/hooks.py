"""The model-level class hooks: on while a session is open or an attached model traces a step.

Hooks that act on attached models only, deciding per object (`record.of`), never
by the calling thread: ``Layer.losses`` (16-bit loss terms summed in float32,
`tfmp._src.keras_hooks.loss_terms`), ``tf.GradientTape.gradient`` (backward-pass
dtype mismatches explained, `tfmp._src.float32.gradient_errors`), Keras's backend
``add`` (16-bit bias gradients summed with float32 accumulation,
`tfmp._src.float32.bias_gradient`), and the speed features' (`SPEED`):
``BatchNormalization.call`` (the fused kernel, `tfmp._src.float32.fused_batchnorm`),
Keras's backend ``gelu`` (float32 inside, `tfmp._src.float32.gelu`), its ``conv``
and ``conv_transpose`` (float16 convolutions in float32 inside,
`tfmp._src.float32.conv`).

`hold` installs them while a session is open, a speed feature's only where the
session's ``speedups`` has it on. Without a session they are on inside `in_step`
(a compiled attached model's step while Keras traces it, see
`tfmp._src.keras_hooks.step_scope`, or a `tfmp.step_scope` block) and while a layer
attached at its first call lives (a custom loop over a model never compiled, whose
step tfmp cannot wrap). So once no thread is enabled, a model tfmp did not attach
runs none of them, unless it runs while an attached model computes in another
thread (the hooks are on for the process then, and leave it to Keras).
`release_if_unused` takes them off when nothing holds them (never from a
garbage-collection callback, which can run in any thread while another holds the
hooks' lock).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, Mapping, Optional

from tfmp._src.attachment import record
from tfmp._src.float32 import bias_gradient, conv, fused_batchnorm, gelu, gradient_errors
from tfmp._src.keras_hooks import layer_calls, surfaces
from tfmp._src.keras_hooks.loss_terms import install_losses_hook
from tfmp._src.policy import session, speedups

_hooks: Dict[str, List[surfaces.Hook]] = {}  # "losses" or an optional feature -> its hooks
_lock = threading.RLock()
_steps = 0  # `in_step` blocks open, in any thread
#: The optional features among them, each installed on its own: where its Keras surface
#: is missing it is switched off with one warning (`availability`), and the rest go on.
OPTIONAL = (("fused_batchnorm", fused_batchnorm.install), ("gradient_errors", gradient_errors.install),
            ("gelu", gelu.install), ("conv", conv.install), ("bias_gradient", bias_gradient.install))
#: The speed features of `OPTIONAL` (`tfmp._src.policy.speedups.FEATURES`): installed
#: only where a session's or an attached model's ``speedups`` has them on.
SPEED = frozenset(feature for feature, _ in OPTIONAL if feature in speedups.FEATURES)


def speed_features(speedups: Optional[Mapping[str, bool]]) -> FrozenSet[str]:
    """The features of `SPEED` a ``speedups`` switch leaves on (None: all of them).

    Args:
        speedups: Dict of speed feature -> wanted (a session's or an attached
            model's, `tfmp._src.policy.speedups.checked_speedups`), or None.
    """
    return frozenset(name for name in SPEED if speedups is None or speedups[name])


def hold(speed_features: Iterable[str] = ()) -> None:
    """Installs the model-level hooks that are not on, and the speed features' named.

    Args:
        speed_features: Names of `SPEED` that a session opening, or a model
            about to be attached, has on.

    Raises:
        Whatever installing a core hook raises; none of them is then installed. An
        optional one (`OPTIONAL`) that fails is switched off instead (`availability`).
    """
    wanted = set(speed_features)
    with _lock:
        if "losses" not in _hooks:
            _hooks["losses"] = surfaces.all_or_none([install_losses_hook])
        for feature, install in OPTIONAL:
            if feature not in _hooks and (feature not in SPEED or feature in wanted):
                _hooks[feature] = surfaces.optional(feature, install)


@contextlib.contextmanager
def in_step(speed_features: Iterable[str] = ()) -> Iterator[None]:
    """Keeps the model-level hooks, and the speed features' named, on inside the block.

    Entered by an attached layer's call, while Keras traces an attached model's
    step, and by `tfmp.step_scope`; a step already traced runs in its graph
    without Python, so in `fit` the hooks go on and off once per trace. Without
    a session, an eager call of an attached model installs and removes them
    at each outermost call.

    Args:
        speed_features: Names of `SPEED` that the model has on.

    Raises:
        Whatever `hold` raises; the block does not run then.
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
    """Makes each of `layers` keep the model-level hooks on while its own ``call`` runs.

    A per-object hook on ``call`` (owner ``"attachment"``, outermost) enters `in_step`:
    an attached model's layer called in a custom loop, in eager code or inside a
    model tfmp did not attach computes as in the model's step, also after
    `tfmp.disable()`. A second call replaces a layer's hook (the speed features
    may differ); `tfmp.detach` takes them off.

    Raises:
        Whatever installing a hook raises; the layers hooked before stay hooked.
    """
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
    """Takes the model-level hooks off when no session is open, no `in_step` block runs
    and no layer attached at its first call is alive."""
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
