"""float16 convolutions computed in float32 inside, per model, on CPUs (no fast float16 conv kernels there).

`float32_inside` widens the float16 input and kernel to float32, convolves and computes
both gradients in float32 and rounds each result once to float16 (float32 accumulation,
as TensorFlow asks of cuDNN on a GPU). The rule (`decision`): a float16 model on a machine
without GPUs or TPUs. Measurements: benchmarks/README.md, "float16 on a CPU".
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tfmp._src.float32 import inside
from tfmp._src.keras_hooks import backend_ops
from tfmp._src.policy.hardware import DeviceFacts

#: The one compute dtype changed.
DTYPE = "float16"
#: ``Attachment.conv`` of a model whose float16 convolutions compute in float32 inside.
FLOAT32_INSIDE = inside.FLOAT32_INSIDE
#: ``Attachment.conv`` of a model that keeps Keras's convolutions.
KERAS = inside.KERAS
#: Why a float16 model on a CPU takes `FLOAT32_INSIDE` (``Attachment.conv`` after the colon).
RULE = ("TensorFlow has no fast float16 convolution kernels on a CPU (measured on an AMD EPYC "
        "Zen 4: a float16 Conv2D 9.7x slower than float32, float32 inside as fast as float32)")
#: The Keras backend functions hooked, each ``(inputs, kernel, *args, **kwargs)``.
FUNCTIONS = ("conv", "conv_transpose")


def decision(compute_dtype: str, facts: Optional[DeviceFacts] = None) -> str:
    """``Attachment.conv`` for a model computing in `compute_dtype` here (float16 only, `inside.decided`)."""
    return inside.decided("conv", compute_dtype, DTYPE, RULE, facts)


def float32_inside(convolve: Callable, inputs: Any, kernel: Any) -> Any:
    """``convolve(inputs, kernel)`` (Keras's ``conv``, arguments bound) and its gradients in float32, rounded once."""
    import tensorflow as tf

    @tf.custom_gradient
    def conv(x, k):
        def grad(dy):
            with tf.GradientTape() as tape:
                x32, k32 = tf.cast(x, tf.float32), tf.cast(k, tf.float32)
                tape.watch([x32, k32])
                y32 = convolve(x32, k32)
            dx, dk = tape.gradient(y32, [x32, k32], output_gradients=tf.cast(dy, tf.float32))
            return tf.cast(dx, x.dtype), tf.cast(dk, k.dtype)

        return tf.cast(convolve(tf.cast(x, tf.float32), tf.cast(k, tf.float32)), x.dtype), grad

    return conv(inputs, kernel)


def takes_float32_inside(inputs: Any, kernel: Any) -> bool:
    """Bool. Whether `float32_inside` computes this convolution: float16 operands, a layer attached to take it."""
    if any(_dtype_name(t) != DTYPE for t in (inputs, kernel)):
        return False
    return inside.calling_layer_takes("conv")


def _dtype_name(value: Any) -> Optional[str]:
    """A tensor's or a Keras variable's (a string, its autocast dtype) dtype name."""
    dtype = getattr(value, "dtype", None)
    return dtype if isinstance(dtype, str) else getattr(dtype, "name", None)


def _replace(call: backend_ops.OpCall) -> Any:
    inputs, kernel = call.inputs
    if not takes_float32_inside(inputs, kernel):
        return backend_ops.KERAS
    import tensorflow as tf

    # a Keras variable reads as its float16 value here (autocast); its gradient
    # flows back through that read to the float32 variable
    return float32_inside(call.keras, inputs, tf.convert_to_tensor(kernel))


def install() -> None:
    """Hooks Keras's TensorFlow backend ``conv`` and ``conv_transpose`` (inside `surfaces.all_or_none`)."""
    for name in FUNCTIONS:
        backend_ops.subscribe(name, _replace, owner="conv")
