"""float16 convolutions computed in float32 inside, per model, on CPUs (no fast float16 conv kernels there).

TensorFlow has no fast float16 convolution kernels on a CPU: where its oneDNN does
not take float16 (AMD Zen 4, Intel CPUs before Sapphire Rapids) a float16 Conv2D
runs on Eigen's kernels, and where it does (Sapphire Rapids: AVX512_FP16) oneDNN's
float16 convolutions crawl. Measured on an AMD EPYC Zen 4, TensorFlow 2.21,
2026-12-04 (fastest of 5, forward and both gradients of a 3x3 Conv2D, 32 x 32 x 32
x 64 -> 64): float32 24.0 ms, float16 234 ms (9.7x slower), float16 computed in
float32 inside 25.1 ms. On a Sapphire Rapids, two Conv2D layers' training step ran
147-240x float32's in float16 (2026-12-04). `benchmarks/float16_cpu.py` measures
the model-level effect on the running CPU.

`float32_inside` casts the 16-bit input and kernel to float32 (exact: every
float16 value is a float32 value), convolves in float32 and rounds the result once
to float16: float32 accumulation of float16 products, which is what TensorFlow asks
of cuDNN for float16 convolutions on an NVIDIA GPU (``TF_FP16_CONV_USE_FP32_COMPUTE``,
on by default), so a CPU run matches a float16 GPU run's arithmetic more closely
than Eigen's float16 kernel does. Its ``tf.custom_gradient`` keeps only the 16-bit
input and kernel for the backward pass, whose gradients are computed in float32
and rounded once to float16 the same way.

Decided per model, once, when tfmp attaches it (`decision`, recorded as
``Attachment.conv``), from facts that do not move: a model computing in float16 on
a machine without GPUs or TPUs. GPUs keep Keras's convolutions (cuDNN's float16
kernels are the fast path there); bfloat16 models keep them too (oneDNN's bfloat16
convolutions are fast: 14.5 ms in the measurement above), as does a float32 model.

The hook (owner ``"conv"`` in ``keras_hooks.backend_ops.SURFACE``) replaces ``conv`` and
``conv_transpose`` of Keras's TensorFlow backend module (`backend_ops.backend_nn`),
which ``keras.ops.conv`` / ``conv_transpose`` (so Conv1D/2D/3D and their transposes)
look up at each call; it is one of the model-level hooks
(`tfmp._src.attachment.hooks`). A call takes `float32_inside` when the input and
kernel are float16 and the layer computing it carries an attachment whose ``conv``
starts with `FLOAT32_INSIDE`. Depthwise and separable convolutions keep Keras's
kernels (float16 2.1x slower than float32 on the Zen 4 for a 3x3 depthwise
convolution, and no faster in float32 inside, the casts costing what it saves):
``Attachment.conv`` is the model's rule, and says nothing of a model that has none
of the convolutions hooked. One more effect: TensorFlow's CPU kernels refuse a
float16 ``channels_first`` convolution's gradients (``Conv2DCustomBackpropFilterOp
only supports NHWC``), which plain Keras ``mixed_float16`` meets in ``fit``; in
float32 inside such a model trains, and fails again in float16 once detached or
loaded without tfmp.
"""

from __future__ import annotations

import functools
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
    """``Attachment.conv`` for a model computing in `compute_dtype` on this machine.

    Args:
        compute_dtype: String. The model's compute dtype; only ``"float16"`` changes.
        facts: `DeviceFacts` or None (this machine's, `detect_device_facts`). With
            a GPU or TPU Keras's convolutions are kept.

    Returns:
        String: `KERAS`, or ``"float32 inside: "`` + `RULE`.
    """
    return inside.decided("conv", compute_dtype, DTYPE, RULE, facts)


def float32_inside(convolve: Callable, inputs: Any, kernel: Any) -> Any:
    """``convolve(inputs, kernel)`` computed in float32 and rounded once to `inputs`' dtype.

    Args:
        convolve: Callable ``(inputs, kernel) -> output`` (Keras's backend
            ``conv`` with its other arguments bound).
        inputs: float16 `tf.Tensor`.
        kernel: float16 `tf.Tensor`.

    Returns:
        float16 `tf.Tensor`: the output. Its gradients with respect to `inputs`
        and `kernel` are computed in float32 from the saved 16-bit tensors and
        rounded once to float16.
    """
    import tensorflow as tf

    def wide(x, k):
        return convolve(tf.cast(x, tf.float32), tf.cast(k, tf.float32))

    @tf.custom_gradient
    def conv(x, k):
        def grad(dy):
            with tf.GradientTape() as tape:
                x32, k32 = tf.cast(x, tf.float32), tf.cast(k, tf.float32)
                tape.watch([x32, k32])
                y32 = convolve(x32, k32)
            dx, dk = tape.gradient(y32, [x32, k32], output_gradients=tf.cast(dy, tf.float32))
            return tf.cast(dx, x.dtype), tf.cast(dk, k.dtype)

        return tf.cast(wide(x, k), x.dtype), grad

    return conv(inputs, kernel)


def takes_float32_inside(inputs: Any, kernel: Any) -> bool:
    """Bool. Whether this call of Keras's backend convolution is computed by `float32_inside`.

    True when `inputs` and `kernel` are float16 tensors and the layer whose call
    computes it (`layer_calls.calling_layer`) is attached with ``conv``
    starting with `FLOAT32_INSIDE`.
    """
    if any(_dtype_name(t) != DTYPE for t in (inputs, kernel)):
        return False
    return inside.calling_layer_takes("conv")


def _dtype_name(value: Any) -> Optional[str]:
    """A tensor's or a Keras variable's dtype name (a Keras variable's ``dtype`` is a string,
    its compute dtype while a layer autocasts it)."""
    dtype = getattr(value, "dtype", None)
    return dtype if isinstance(dtype, str) else getattr(dtype, "name", None)


def _wrap(next_conv: Callable) -> Callable:
    @functools.wraps(next_conv)
    def conv(inputs, kernel, *args, **kwargs):
        if takes_float32_inside(inputs, kernel):
            import tensorflow as tf

            # a Keras variable reads as its float16 value here (autocast); its gradient
            # flows back through that read to the float32 variable
            kernel = tf.convert_to_tensor(kernel)
            return float32_inside(lambda x, k: next_conv(x, k, *args, **kwargs), inputs, kernel)
        return next_conv(inputs, kernel, *args, **kwargs)

    return conv


def install() -> None:
    """Hooks Keras's TensorFlow backend ``conv`` and ``conv_transpose`` (owner ``"conv"``).

    Called inside `surfaces.all_or_none`, which collects both hooks (to remove them
    together) and installs neither when one fails.
    """
    for name in FUNCTIONS:
        backend_ops.subscribe(name, _wrap, owner="conv")
