"""``model.quantize("int8")`` on a float16 model: the route that works, named.

Keras refuses int8 for a layer computing in float16 and suggests 'mixed_float16', the very
policy of such a model. tfmp hooks ``quantize`` on the float16 models it attaches (owner
``"enable.quantize_hint"``) to re-raise that refusal with a hint naming ``tfmp.to_float32``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import keras

from tfmp._src.deployment.tflite_hint import SECTION
from tfmp._src.errors import opening
from tfmp._src.float32.dtype_errors import with_explanation
from tfmp._src.keras_hooks import error_texts, trainer


def hint(model: Any, mode: str) -> str:
    """The text tfmp appends to Keras's refusal to quantize `model` in `mode` (`errors.opening`)."""
    return "tfmp: " + opening(
        f"Keras refuses quantize({mode!r}) for model {model.name!r}: it computes in float16 "
        f"(dtype policy {model.dtype_policy.name!r}).",
        "The policies Keras suggests do not help a model trained under 'mixed_float16'.",
        "Fix: quantize a float32 copy, same weights: quantized = tfmp.to_float32(model); "
        f"quantized.quantize({mode!r}).",
        SECTION)


def _wrap(model: Any) -> Callable[[Callable], Callable]:
    """The hook: Keras's float16 refusal re-raised with `hint`; anything else unchanged."""

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def tfmp_quantize(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except ValueError as error:
                refused = error_texts.QUANTIZE_FLOAT16.search(str(error))
                if refused is None:
                    raise
                raise with_explanation(error, hint(model, refused.group(1))) from error

        return tfmp_quantize

    return wrap


def explain_quantize(model: keras.Model) -> None:
    """Hooks `model`'s ``quantize`` to name the float32-copy route (idempotent)."""
    if not trainer.subscribed(model, "quantize", "enable.quantize_hint"):
        trainer.subscribe(model, "quantize", _wrap(model), owner="enable.quantize_hint")
