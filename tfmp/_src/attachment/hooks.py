"""The model-level class hooks: held while a session is open or an attached object lives.

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

`hold` installs the first three when a session opens or a model is attached, and
a speed feature's only for a session or a model that has the feature on
(``tfmp.enable(speedups=...)``): ``tfmp.enable(speedups=False)`` installs none. They stay while an attached
model may still trace a step, also after `tfmp.disable()`; `release_if_unused`
takes them off once no thread has a session and no attached object is alive
(called by `tfmp.disable()` and `tfmp.detach()`, never from a garbage-collection
callback, which can run in any thread while another holds the hooks' lock).
"""

from __future__ import annotations

import threading
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional

from tfmp._src.attachment import record
from tfmp._src.float32 import bias_gradient, conv, fused_batchnorm, gelu, gradient_errors
from tfmp._src.keras_hooks import surfaces
from tfmp._src.keras_hooks.loss_terms import install_losses_hook
from tfmp._src.policy import session, speedups

_hooks: Dict[str, List[surfaces.Hook]] = {}  # "losses" or an optional feature -> its hooks
_lock = threading.RLock()
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


def release_if_unused() -> None:
    """Takes the model-level hooks off when no session is open and no attached object is alive."""
    with session.lock, _lock:  # session.lock first, as enable() takes them
        if _hooks and not session.any_open() and not record.any_marked():
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
