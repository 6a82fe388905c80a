"""float16 convolutions computed in float32 inside, per model, on CPUs where TensorFlow's float16 kernels are slow.

`float32_inside` widens the float16 input and kernels to float32, convolves and computes
every gradient in float32 and rounds each result once to float16 (float32 accumulation,
as TensorFlow asks of cuDNN on a GPU). Two rules, each kept in its own `Attachment` field:

- `decision` (``Attachment.conv``): Conv1D/2D/3D, their transposes and SeparableConv1D/2D
  (whose pointwise half is a Conv2D) of a float16 model on a machine without GPUs or TPUs;
- `depthwise_decision` (``Attachment.depthwise_conv``): DepthwiseConv1D/2D of a float16
  model on such a machine whose TensorFlow oneDNN takes float16
  (`DeviceFacts.onednn_float16`); elsewhere TensorFlow's float16 depthwise kernel is
  Eigen's, as fast as float32 inside.

Measurements: benchmarks/README.md, "float16 on a CPU".
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from tfmp._src.attachment import record
from tfmp._src.float32 import inside
from tfmp._src.keras_hooks import backend_ops
from tfmp._src.policy.hardware import DeviceFacts, detect_device_facts

#: The one compute dtype changed.
DTYPE = "float16"
#: ``Attachment.conv`` / ``depthwise_conv`` of a model whose float16 convolutions compute in float32 inside.
FLOAT32_INSIDE = inside.FLOAT32_INSIDE
#: ``Attachment.conv`` / ``depthwise_conv`` of a model that keeps Keras's convolutions.
KERAS = inside.KERAS
#: Why a float16 model on a CPU takes `FLOAT32_INSIDE` (``Attachment.conv`` after the colon).
RULE = ("TensorFlow's float16 convolution kernels on a CPU (Eigen's, or oneDNN's where it takes "
        "float16) are slower than its float32 ones (benchmarks/README.md, \"float16 on a CPU\")")
#: Why a float16 model's depthwise convolutions take `FLOAT32_INSIDE` (``Attachment.depthwise_conv``).
DEPTHWISE_RULE = ("TensorFlow's oneDNN takes float16 on this CPU (DeviceFacts.onednn_float16), and its "
                  "float16 depthwise convolutions are far slower than float32 ones (benchmarks/README.md, "
                  "\"float16 on a CPU\")")
#: Why they keep Keras's on another CPU (``Attachment.depthwise_conv`` after ``"keras: "``).
DEPTHWISE_KEPT = ("TensorFlow's oneDNN does not take float16 on this CPU (DeviceFacts.onednn_float16), so "
                  "its float16 depthwise convolutions are Eigen's, about as fast as float32 inside")
#: The Keras backend functions hooked, each ``(inputs, *kernels, *args, **kwargs)``, by the
#: `Attachment` field that decides them.
FUNCTIONS = {"conv": "conv", "conv_transpose": "conv", "separable_conv": "conv",
             "depthwise_conv": "depthwise_conv"}
#: Keras's convolution layers (class names) by the `Attachment` field that decides them (`audit_reason`).
LAYERS = {"conv": ("Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
                   "SeparableConv1D", "SeparableConv2D"),
          "depthwise_conv": ("DepthwiseConv1D", "DepthwiseConv2D")}


def decision(compute_dtype: str, facts: Optional[DeviceFacts] = None) -> str:
    """``Attachment.conv`` for a model computing in `compute_dtype` here (float16 only, `inside.decided`)."""
    return inside.decided("conv", compute_dtype, DTYPE, RULE, facts)


def depthwise_decision(compute_dtype: str, facts: Optional[DeviceFacts] = None) -> str:
    """``Attachment.depthwise_conv`` for a model computing in `compute_dtype` on a machine with `facts`.

    As `decision` (`inside.kept_as_keras`: float16 only, no GPU or TPU, the ``conv``
    feature's surface there), and then only where `DeviceFacts.onednn_float16` holds:
    ``"float32 inside: "`` + `DEPTHWISE_RULE`, else ``"keras: "`` + `DEPTHWISE_KEPT`.
    `facts` None reads this machine's.
    """
    facts = facts if facts is not None else detect_device_facts()
    kept = inside.kept_as_keras("conv", compute_dtype == DTYPE, facts)
    if kept:
        return kept
    return f"{FLOAT32_INSIDE}: {DEPTHWISE_RULE}" if facts.onednn_float16 else f"{KERAS}: {DEPTHWISE_KEPT}"


def audit_reason(layer: Any) -> Optional[str]:
    """``"float32 inside tfmp (Attachment.<field>)"`` for a float16 Keras convolution layer (`LAYERS`)
    whose attached model computes it so (`tfmp.audit`'s ``why``), else None."""
    import keras

    found = record.of(layer)
    if found is None or layer.compute_dtype != DTYPE:
        return None
    for field, names in LAYERS.items():
        if (getattr(found, field).startswith(FLOAT32_INSIDE)
                and any(isinstance(layer, getattr(keras.layers, name, ())) for name in names)):
            return f"{FLOAT32_INSIDE} tfmp (Attachment.{field})"
    return None


def float32_inside(convolve: Callable, inputs: Any, *kernels: Any) -> Any:
    """``convolve(inputs, *kernels)`` (a Keras backend convolution, other arguments bound) and its
    gradients in float32, each rounded once to its operand's dtype."""
    import tensorflow as tf

    def widened(tensors):
        return [tf.cast(t, tf.float32) for t in tensors]

    @tf.custom_gradient
    def conv(*operands):
        def grad(dy):
            with tf.GradientTape() as tape:
                wide = widened(operands)
                tape.watch(wide)
                y32 = convolve(*wide)
            found = tape.gradient(y32, wide, output_gradients=tf.cast(dy, tf.float32))
            return [tf.cast(g, t.dtype) for g, t in zip(found, operands)]

        return tf.cast(convolve(*widened(operands)), operands[0].dtype), grad

    return conv(inputs, *kernels)


def takes_float32_inside(field: str, *tensors: Any) -> bool:
    """Bool. Whether `float32_inside` computes this convolution: float16 `tensors` (input and
    kernels), a calling layer attached with `field` (``"conv"``, ``"depthwise_conv"``) taking it."""
    if any(_dtype_name(t) != DTYPE for t in tensors):
        return False
    return inside.calling_layer_takes(field)


def _dtype_name(value: Any) -> Optional[str]:
    """A tensor's or a Keras variable's (a string, its autocast dtype) dtype name."""
    dtype = getattr(value, "dtype", None)
    return dtype if isinstance(dtype, str) else getattr(dtype, "name", None)


def _replace(field: str, call: backend_ops.OpCall) -> Any:
    if not takes_float32_inside(field, *call.inputs):
        return backend_ops.KERAS
    import tensorflow as tf

    # a Keras variable reads as its float16 value here (autocast); its gradient
    # flows back through that read to the float32 variable
    inputs, *kernels = call.inputs
    return float32_inside(call.keras, inputs, *(tf.convert_to_tensor(k) for k in kernels))


def install() -> None:
    """Hooks Keras's TensorFlow backend convolutions, `FUNCTIONS` (inside `surfaces.all_or_none`)."""
    for name, field in FUNCTIONS.items():
        backend_ops.subscribe(name, functools.partial(_replace, field), owner="conv")
