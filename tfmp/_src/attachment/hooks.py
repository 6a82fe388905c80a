"""The model-level class hooks: held while a session is open or an attached object lives.

Six hooks act on attached models only, deciding per object (`record.of`), never
by the calling thread: ``Layer.losses`` (16-bit loss terms summed in float32,
`tfmp._src.keras_hooks.loss_terms`), ``BatchNormalization.call`` (the fused
kernel, `tfmp._src.float32.fused_batchnorm`), Keras's backend ``gelu`` (float32
inside, `tfmp._src.float32.gelu`), its ``conv`` and ``conv_transpose`` (float16
convolutions in float32 inside, `tfmp._src.float32.conv`), its ``add`` (16-bit bias gradients summed with
float32 accumulation, `tfmp._src.float32.bias_gradient`) and ``tf.GradientTape.gradient``
(backward-pass dtype mismatches explained, `tfmp._src.float32.gradient_errors`).
They are installed together (all or none) by `hold`, when a session opens or a
model is attached, and stay while an attached model may still trace a step, also
after `tfmp.disable()`.
`release_if_unused` takes them off once no thread has a session and no attached
object is alive: called by `tfmp.disable()` and `tfmp.detach()`, never from a
garbage-collection callback (which can run in any thread while another holds
the hooks' lock).
"""

from __future__ import annotations

import threading
from typing import List

from tfmp._src.attachment import record
from tfmp._src.float32 import bias_gradient, conv, fused_batchnorm, gelu, gradient_errors
from tfmp._src.keras_hooks import surfaces
from tfmp._src.keras_hooks.loss_terms import install_losses_hook
from tfmp._src.policy import session

_hooks: List[surfaces.Hook] = []
_lock = threading.RLock()
#: The optional features among them, each installed on its own: where its Keras surface
#: is missing it is switched off with one warning (`availability`), and the rest go on.
OPTIONAL = (("fused_batchnorm", fused_batchnorm.install), ("gradient_errors", gradient_errors.install),
            ("gelu", gelu.install), ("conv", conv.install), ("bias_gradient", bias_gradient.install))


def hold() -> None:
    """Installs the model-level hooks unless they are on.

    Raises:
        Whatever installing a core hook raises; none of them is then installed. An
        optional one (`OPTIONAL`) that fails is switched off instead (`availability`).
    """
    with _lock:
        if not _hooks:
            _hooks.extend(surfaces.all_or_none([install_losses_hook]))
            for feature, install in OPTIONAL:
                _hooks.extend(surfaces.optional(feature, install))


def release_if_unused() -> None:
    """Takes the model-level hooks off when no session is open and no attached object is alive."""
    with session.lock, _lock:  # session.lock first, as enable() takes them
        if _hooks and not session.any_open() and not record.any_marked():
            while _hooks:
                _hooks[-1].remove()  # kept in the list if removing raises
                _hooks.pop()


def installed() -> List[surfaces.Hook]:
    """The model-level hooks now on (for the test suite's leak guard)."""
    with _lock:
        return list(_hooks)
