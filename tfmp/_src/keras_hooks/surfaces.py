"""The surfaces of Keras and TensorFlow tfmp hooks or reads, one module each, and what spans them.

A feature subscribes through the module owning a surface and never installs a hook or reads a
private name itself (``tests/test_keras_hooks.py`` checks every module's source); the table of
surfaces is in docs/architecture.md.
"""

from __future__ import annotations

import types
from typing import Any, Callable, List, Sequence

from tfmp._src.keras_hooks import (
    availability,
    backend_ops,
    export_io,
    gradient_tape,
    layer_calls,
    loss_terms,
    optimizer_steps,
    patches,
    trainer,
)

Hook = patches.Hook

HOOKED = (trainer.SURFACE, layer_calls.SURFACE, loss_terms.SURFACE, optimizer_steps.SURFACE,
          backend_ops.SURFACE, gradient_tape.SURFACE, export_io.SURFACE)


def subscriptions_on(target: Any) -> List[patches.Hook]:
    """Every active hook on `target` (an object, a class or a module), of any surface."""
    return patches.installed(target)


def all_or_none(installers: Sequence[Callable[[], Any]]) -> List[patches.Hook]:
    """Runs each installer (subscribing through surfaces); every hook stays, or none (`patches.install_all`)."""
    return patches.install_all(installers)


def optional(feature: str, installer: Callable[[], Any]) -> List[patches.Hook]:
    """The hooks `installer` subscribes for `feature` (of `availability.FEATURES`), all or none.

    [] when the feature is off in this process: switched off now (it failed; one warning) or before.
    """
    if availability.off(feature):
        return []
    try:
        return patches.install_all([installer])
    except Exception as error:  # noqa: BLE001 (any failure of an optional feature)
        availability.switch_off(feature, error)
        return []


def process_wide() -> List[patches.Hook]:
    """Every hook now on a class or a module (seen by every object), of any surface."""
    hooks = [hook for slots in patches.class_slots() for slot in slots.values() for hook in slot.hooks]
    modules = []
    for function in ("gelu", "add", "dropout"):  # one per backend module
        try:
            modules.append(backend_ops.module_of(function))
        except AttributeError:  # moved in this Keras: no tfmp hook can be on it
            pass
    return hooks + [hook for module in modules if isinstance(module, types.ModuleType)
                    for hook in patches.installed(module)]
