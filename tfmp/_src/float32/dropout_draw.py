"""A 16-bit dropout's uniform draw made in float32, per model, so it drops its rate.

Keras's ``dropout`` (``Dropout``, ``SpatialDropout1D/2D/3D``, ``keras.random.dropout``) calls
``tf.nn.experimental.stateless_dropout``, which draws its uniform noise in the inputs' dtype:
steps of 1/128 in bfloat16, 1/1024 in float16, so a value is dropped when its draw is below
the rate rounded up to the next step (`Dropout(0.002)` drops 0.78% in bfloat16, 0.29% in float16).
`float32_draw` runs Keras's own dropout on the inputs widened to float32 (draw, comparison and
the ``1 / (1 - rate)`` scaling in float32) and rounds the result once to the inputs' dtype.
"""

from __future__ import annotations

from typing import Any, Callable

from tfmp._src.attachment import record
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import availability, backend_ops, layer_calls

#: ``Attachment.dropout`` (before the colon) of a 16-bit model whose dropout draws in float32.
FLOAT32_DRAW = "float32 draw"
#: ``Attachment.dropout`` of a model that keeps Keras's dropout (a float32 model).
KERAS = "keras"
#: Why a 16-bit model takes `FLOAT32_DRAW` (``Attachment.dropout`` after the colon).
RULE = ("TensorFlow draws a dropout's uniform noise in the inputs' dtype, in steps of 1/128 in "
        "bfloat16 and 1/1024 in float16 (measured: Dropout(0.002) drops 3.9x its rate in "
        "bfloat16, 1.5x in float16)")


def decision(compute_dtype: str) -> str:
    """``Attachment.dropout`` for a model computing in `compute_dtype` (String).

    ``"float32 draw: <RULE>"`` for bfloat16 or float16 on any device, `KERAS` otherwise,
    ``"keras: off, <why>"`` where Keras moved its backend ``dropout`` (`availability`).
    """
    if compute_dtype not in LOW_PRECISION:
        return KERAS
    missing = availability.off("dropout")
    return f"{KERAS}: off, {missing}" if missing else f"{FLOAT32_DRAW}: {RULE}"


def float32_draw(dropout: Callable[[Any], Any], inputs: Any) -> Any:
    """``dropout(inputs)`` (Keras's, rate, noise shape and seed bound) on `inputs` widened to float32,
    rounded once to `inputs`' 16-bit dtype (same shape and dtype as `inputs`)."""
    import tensorflow as tf

    dtype = tf.as_dtype(inputs.dtype)
    return tf.cast(dropout(tf.cast(inputs, tf.float32)), dtype)


def takes_float32_draw(inputs: Any) -> bool:
    """Bool. 16-bit `inputs` of a layer whose attached model's ``dropout`` starts with `FLOAT32_DRAW`."""
    dtype = getattr(inputs, "dtype", None)
    if getattr(dtype, "name", dtype) not in LOW_PRECISION:
        return False
    found = record.of_calling(layer_calls.calling_layer())
    return found is not None and found.dropout.startswith(FLOAT32_DRAW)


def _replace(call: backend_ops.OpCall) -> Any:
    (inputs,) = call.inputs
    return float32_draw(call.keras, inputs) if takes_float32_draw(inputs) else backend_ops.KERAS


def install() -> backend_ops.Hook:
    """Hooks Keras's TensorFlow backend ``dropout``; ``.remove()`` the returned `Hook` to undo."""
    return backend_ops.subscribe("dropout", _replace, owner="dropout")
