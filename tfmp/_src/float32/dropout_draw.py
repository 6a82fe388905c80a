"""A 16-bit dropout that drops its rate, per model: an exact draw, its scaling in float32.

Keras's ``dropout`` (``Dropout``, ``SpatialDropout1D/2D/3D``, ``keras.random.dropout``) calls
``tf.nn.experimental.stateless_dropout``, which draws its uniform noise in the inputs' dtype:
steps of 1/128 in bfloat16, 1/1024 in float16, so a value is dropped when its draw is below
the rate rounded up to the next step (`Dropout(0.002)` drops 0.78% in bfloat16, 0.29% in float16).
`exact_draw` keeps or drops each value on 16 random bits (the rate to within 2^-17; each 32-bit
draw of Keras's ``keras.random.randint``, with the layer's seed, decides two values, half the
random numbers a float draw takes), scales the kept ones by ``1 / (1 - rate)`` in float32 and rounds
once to the inputs' dtype. A rate given as a tensor, or closer than 2^-16 to 0 or 1, takes
`float32_draw`: Keras's own dropout on the inputs widened to float32.
Measurements: benchmarks/README.md, "Dropout from 16 random bits".
"""

from __future__ import annotations

from typing import Any, Callable

from tfmp._src.attachment import record
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import availability, backend_ops, layer_calls

#: ``Attachment.dropout`` (before the colon) of a 16-bit model whose dropout drops its rate.
EXACT_DRAW = "exact draw"
#: Random bits that decide one value (`exact_draw`).
BITS = 16
#: ``Attachment.dropout`` of a model that keeps Keras's dropout (a float32 model).
KERAS = "keras"
#: Why a 16-bit model takes `EXACT_DRAW` (``Attachment.dropout`` after the colon).
RULE = ("TensorFlow draws a dropout's uniform noise in the inputs' dtype, in steps of 1/128 in "
        "bfloat16 and 1/1024 in float16 (measured: Dropout(0.002) drops 3.9x its rate in "
        "bfloat16, 1.5x in float16)")


def decision(compute_dtype: str) -> str:
    """``Attachment.dropout`` for a model computing in `compute_dtype` (String).

    ``"exact draw: <RULE>"`` for bfloat16 or float16 on any device, `KERAS` otherwise,
    ``"keras: off, <why>"`` where Keras moved its backend ``dropout`` (`availability`).
    """
    if compute_dtype not in LOW_PRECISION:
        return KERAS
    missing = availability.off("dropout")
    return f"{KERAS}: off, {missing}" if missing else f"{EXACT_DRAW}: {RULE}"


def float32_draw(dropout: Callable[[Any], Any], inputs: Any) -> Any:
    """``dropout(inputs)`` (Keras's, rate, noise shape and seed bound) on `inputs` widened to float32,
    rounded once to `inputs`' 16-bit dtype (same shape and dtype as `inputs`)."""
    import tensorflow as tf

    dtype = tf.as_dtype(inputs.dtype)
    return tf.cast(dropout(tf.cast(inputs, tf.float32)), dtype)


def exact_draw(inputs: Any, rate: float, noise_shape: Any, seed: Any) -> Any:
    """Keras's ``dropout(inputs, rate, noise_shape, seed)`` deciding each value on `BITS` random bits.

    Args:
        inputs: 16-bit tensor of any shape.
        rate: Float in ``[2**-16, 1 - 2**-16]``: the fraction dropped (to within ``2**-17``).
        noise_shape: None or a shape broadcast against `inputs` (None entries: `inputs`' sizes), as Keras's.
        seed: As Keras's ``dropout`` takes it (a ``keras.random.SeedGenerator``, an int or None),
            drawn once by ``keras.random.randint``, as Keras's ``dropout`` draws it.

    Returns:
        Tensor of `inputs`' shape and dtype: 0 where dropped, ``inputs / (1 - rate)`` (computed in float32,
        rounded once) elsewhere.
    """
    import keras
    import tensorflow as tf

    sizes = tf.shape(inputs)
    shape = sizes if noise_shape is None else tf.stack(
        [sizes[axis] if size is None else size for axis, size in enumerate(noise_shape)])
    count = tf.reduce_prod(shape)
    # every 32-bit draw (all 2**32 - 1 values but one) split into two 16-bit ones
    pairs = keras.random.randint([(count + 1) // 2], -2**31, 2**31 - 1, dtype="int32", seed=seed)
    draws = tf.reshape(tf.reshape(tf.bitcast(pairs, tf.uint16), [-1])[:count], shape)
    keep = draws >= tf.constant(round(rate * 2**BITS), tf.uint16)  # at most 2**16 - 1 for such a rate
    scaled = tf.cast(inputs, tf.float32) * (1.0 / (1.0 - rate))
    return tf.cast(tf.where(keep, scaled, 0.0), inputs.dtype)


def _exact_rate(rate: Any) -> bool:
    """Bool. `rate` is a number `exact_draw` takes (not a tensor; at least ``2**-16`` from 0 and 1)."""
    return isinstance(rate, (int, float)) and not isinstance(rate, bool) and \
        2.0**-BITS <= rate <= 1.0 - 2.0**-BITS


def takes_exact_draw(inputs: Any) -> bool:
    """Bool. 16-bit `inputs` of a layer whose attached model's ``dropout`` starts with `EXACT_DRAW`."""
    dtype = getattr(inputs, "dtype", None)
    if getattr(dtype, "name", dtype) not in LOW_PRECISION:
        return False
    found = record.of_calling(layer_calls.calling_layer())
    return found is not None and found.dropout.startswith(EXACT_DRAW)


def _replace(call: backend_ops.OpCall) -> Any:
    (inputs,) = call.inputs
    if not takes_exact_draw(inputs):
        return backend_ops.KERAS
    options = call.options or {}
    if _exact_rate(options.get("rate")):
        return exact_draw(inputs, float(options["rate"]), options["noise_shape"], options["seed"])
    return float32_draw(call.keras, inputs)


def install() -> backend_ops.Hook:
    """Hooks Keras's TensorFlow backend ``dropout``; ``.remove()`` the returned `Hook` to undo."""
    return backend_ops.subscribe("dropout", _replace, owner="dropout")
