"""Activity regularizers of 16-bit layers computed on the output cast to float32.

Keras computes ``activity_regularizer(output)`` in the output's dtype: an L2 sum of
float16 activations overflows 65504 within a few dozen values (inf at every step), and
bfloat16 rounds it to 8 significant bits. For a 16-bit layer tfmp attaches, the
regularizer gets the output cast to float32; saving and `tfmp.detach` keep the user's own.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import layer_calls
from tfmp._src.keras_hooks.loss_terms import to_float32

_OWNER = "float32.regularizer"


class Float32Regularizer:
    """Calls `regularizer` on its input cast to float32 (16-bit inputs only).

    Attributes:
        regularizer: The layer's own activity regularizer (any callable).
    """

    def __init__(self, regularizer: Callable[[Any], Any]) -> None:
        self.regularizer = regularizer

    def __call__(self, x: Any) -> Any:
        return self.regularizer(to_float32(x))

    def __repr__(self) -> str:
        return f"<tfmp Float32Regularizer of {self.regularizer!r}>"


def regularize_in_float32(layer: Any) -> bool:
    """Makes a 16-bit `layer`'s activity regularizer compute in float32; True when it has one."""
    regularizer = getattr(layer, "activity_regularizer", None)
    if regularizer is None or layer.compute_dtype not in LOW_PRECISION:
        return False
    if not isinstance(regularizer, Float32Regularizer):
        object.__setattr__(layer, "activity_regularizer", Float32Regularizer(regularizer))
        layer_calls.subscribe(layer, "get_config", functools.partial(_saved_as_keras, weakref.ref(layer)),
                              owner=_OWNER)
    return True


def regularize_as_keras(layer: Any) -> None:
    """Gives `layer` its own activity regularizer back (`tfmp.detach`; the hook goes with the others)."""
    regularizer = getattr(layer, "activity_regularizer", None)
    if isinstance(regularizer, Float32Regularizer):
        object.__setattr__(layer, "activity_regularizer", regularizer.regularizer)
    layer_calls.SURFACE.unsubscribe(layer, "get_config", _OWNER)


def _saved_as_keras(layer_ref: "weakref.ref[Any]", get_config: Callable) -> Callable:
    """``get_config`` with the user's regularizer in place for the call."""

    @functools.wraps(get_config)
    def get_config_as_saved(*args: Any, **kwargs: Any) -> Any:
        layer = layer_ref()
        current = getattr(layer, "activity_regularizer", None)
        if not isinstance(current, Float32Regularizer):
            return get_config(*args, **kwargs)
        object.__setattr__(layer, "activity_regularizer", current.regularizer)
        try:
            return get_config(*args, **kwargs)
        finally:
            object.__setattr__(layer, "activity_regularizer", current)

    return get_config_as_saved
