"""Activity regularizers of 16-bit layers computed on the output cast to float32.

Keras's ``Layer.__call__`` adds ``activity_regularizer(output)`` to the layer's
loss terms, computed in the output's dtype. `keras.regularizers.L2` sums
``x**2`` first: over float16 activations of about 120 the sum passes 65504 (the
largest float16) after a few dozen values, so the term is inf at every step and
dynamic loss scaling skips steps it cannot fix (the later float32 cast of the
term, `tfmp._src.keras_hooks.loss_terms`, comes too late). bfloat16 keeps the
range but rounds the sum to 8 significant bits.

For a layer tfmp attaches that computes in 16 bits, the regularizer is called on
the output cast to float32 (`Float32Regularizer`); saving writes the user's own
regularizer (a hook on the layer's ``get_config``, owner
``"float32.regularizer"``), and `tfmp.detach` puts it back.
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
    """Makes `layer`'s activity regularizer compute in float32 when the layer computes in 16 bits.

    Returns:
        Bool. True when `layer` has an activity regularizer and computes in
        float16 or bfloat16 (now, or already before).
    """
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
