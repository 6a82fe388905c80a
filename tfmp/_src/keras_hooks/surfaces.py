"""The surfaces of Keras and TensorFlow tfmp hooks or reads, one module each, and what spans them.

A feature of tfmp subscribes to a surface through the module that owns it and
never installs a hook or reads a private name itself
(`tests/test_keras_hooks.py` checks every module's source for both):

| surface | module | hooked methods | private names read |
|---|---|---|---|
| the trainer (compile, loading, train/test/predict functions, ``fit``, saving) | `trainer` (+ `train_function`, `step_scope`, `fit_lifecycle`, `multi_worker`) | yes | yes |
| ``Layer.call`` / ``build`` / output spec / ``__init__`` / ``from_config`` | `layer_calls` | yes | yes |
| ``Layer.losses`` | `loss_terms` | yes | yes |
| the optimizer's ``apply`` / ``scale_loss`` / ``update_step`` | `optimizer_steps` | yes | yes |
| the functional graph | `functional_graph` | no | yes |
| Keras's backend ops (``gelu``, ``conv``, ``conv_transpose``, ``add``) | `backend_ops` | yes | yes |
| ``tf.GradientTape.gradient`` | `gradient_tape` | yes | no |
| error texts and frames | `error_texts` | no | texts |
| TensorFlow's runtime options | `runtime_options` | no | yes |
| ``Model.export`` and the TFLite converter | `export_io` | no | yes |

A maintainer reads this package against a Keras or TensorFlow release diff;
`contracts` gathers each surface's contract rows, each tested.
"""

from __future__ import annotations

import types
from typing import Any, Callable, List, Sequence

from tfmp._src.keras_hooks import (
    availability,
    backend_ops,
    gradient_tape,
    layer_calls,
    loss_terms,
    optimizer_steps,
    patches,
    trainer,
)

Hook = patches.Hook

#: Every surface with hooks, in the order the docs list them.
HOOKED = (trainer.SURFACE, layer_calls.SURFACE, loss_terms.SURFACE, optimizer_steps.SURFACE,
          backend_ops.SURFACE, gradient_tape.SURFACE)


def subscriptions_on(target: Any) -> List[patches.Hook]:
    """Every active hook on `target` (an object, a class or a module), of any surface."""
    return patches.installed(target)


def all_or_none(installers: Sequence[Callable[[], Any]]) -> List[patches.Hook]:
    """Runs each installer (subscribing through surfaces); every hook stays, or none (`patches.install_all`)."""
    return patches.install_all(installers)


def optional(feature: str, installer: Callable[[], Any]) -> List[patches.Hook]:
    """Installs an optional feature's hooks, all or none; where that fails, the feature is off.

    Args:
        feature: String, a key of `availability.FEATURES`.
        installer: Callable without arguments subscribing the feature's hooks.

    Returns:
        List of the hooks installed; [] when the feature is off in this process
        (switched off now, with one warning naming it and the versions, or before).
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
    for function in ("gelu", "add"):
        try:
            modules.append(backend_ops.module_of(function))
        except AttributeError:  # moved in this Keras: no tfmp hook can be on it
            pass
    return hooks + [hook for module in modules if isinstance(module, types.ModuleType)
                    for hook in patches.installed(module)]
