"""What tfmp assumes of Keras, gathered from each surface module's rows, each row tested.

`HOOKED_SIGNATURES`: ``(class, method, parameters)`` of each method a hook replaces and names
(in Keras's order after ``self``; a hook passing ``*args, **kwargs`` through needs none).
`CALL_ORDER`: what tfmp relies on Keras calling when, each with the test that checks it.
``tests/test_keras_hooks.py`` checks both on the oldest and the newest supported Keras.
"""

from __future__ import annotations

from typing import Tuple

from tfmp._src.keras_hooks import (
    backend_ops,
    export_io,
    gradient_tape,
    layer_calls,
    loss_terms,
    optimizer_steps,
    runtime_options,
    trainer,
)

_SURFACE_MODULES = (trainer, layer_calls, loss_terms, optimizer_steps, backend_ops, gradient_tape,
                    runtime_options, export_io)

HOOKED_SIGNATURES: Tuple[Tuple[type, str, Tuple[str, ...]], ...] = tuple(
    row for module in _SURFACE_MODULES for row in getattr(module, "SIGNATURES", ()))

CALL_ORDER: Tuple[Tuple[str, str], ...] = tuple(
    row for module in _SURFACE_MODULES for row in getattr(module, "CALL_ORDER", ()))

#: (class, attribute) pairs the installed Keras's classes must have (tested).
REQUIRED_ATTRIBUTES: Tuple[Tuple[type, str], ...] = tuple(
    row for module in _SURFACE_MODULES for row in getattr(module, "REQUIRED_ATTRIBUTES", ()))
