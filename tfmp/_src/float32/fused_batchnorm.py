"""BatchNormalization on TensorFlow's fused kernel for the mixed-policy layers tfmp attached.

Keras's ``BatchNormalization.call`` casts 16-bit inputs to float32 and runs separate ops;
``FusedBatchNormV3`` takes the 16-bit ``x`` and computes in float32 inside one op. `install`
hooks the class's ``call``; a call takes the kernel when `call_reason` returns ``""``.
Moving statistics follow Keras's formula; `step_state` keeps them on a skipped step.
Measurements: benchmarks/README.md, "BatchNormalization".
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import keras
import tensorflow as tf

from tfmp._src.attachment import record
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import layer_calls
from tfmp._src.float32 import step_state
from tfmp._src.policy import speedups

FUSED = "fused"
NOT_ATTACHED = "not attached to tfmp (compile or first call it while tfmp is enabled)"
_FORMATS = {(4, False): "NHWC", (4, True): "NCHW", (5, False): "NDHWC", (5, True): "NCDHW"}
_INPUT_DTYPES = ("float16", "bfloat16", "float32")
#: layer -> why its last call took Keras's path ("" when it took the fused kernel).
_last_call: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _shape_reason(layer: keras.layers.Layer, rank: Optional[int]) -> str:
    if rank is None:
        return "input rank unknown"
    if rank not in (4, 5):
        return f"input rank {rank} (the fused kernel takes 4 or 5)"
    if layer.axis % rank not in (1, rank - 1):
        return f"axis {layer.axis} of a {rank}D input (the fused kernel takes the last axis or axis 1)"
    return ""


def layer_reason(layer: keras.layers.Layer) -> str:
    """Why `layer` cannot take the fused kernel from its configuration alone (``""``: every unmasked call can)."""
    if not record.would_attach(layer):
        return NOT_ATTACHED
    return _configuration_reason(layer)


def _configuration_reason(layer: keras.layers.Layer) -> str:
    found = record.of(layer)
    switched = speedups.off("fused_batchnorm", found.speedups) if found is not None else ""
    if switched:
        return speedups.off_reason(switched)
    if layer.compute_dtype not in LOW_PRECISION or layer.variable_dtype != "float32":
        return f"policy {layer.dtype_policy.name} (the fused path is for mixed policies)"
    if layer.synchronized:
        return "synchronized=True"
    if getattr(layer, "renorm", False):  # Keras 3.13 added renorm
        return "renorm=True"
    if not layer.built or layer.input_spec is None:
        return "not built"
    return _shape_reason(layer, layer.input_spec.ndim)


def call_reason(layer: keras.layers.Layer, inputs: Any, training: Any, mask: Any) -> str:
    """Why this call cannot take the fused kernel (``""``: it can). Same rules as `layer_reason`.

    Attaches `layer` when its thread has a session and it has no attachment yet.
    """
    if not record.attached_or_first_use(layer):
        return NOT_ATTACHED
    why = _configuration_reason(layer)
    if why and why != "not built":
        return why
    if mask is not None:
        return "called with a mask"
    if not (training is None or isinstance(training, bool)):
        return f"training is a {type(training).__name__}, not a Python bool"
    dtype = keras.backend.standardize_dtype(inputs.dtype)
    if dtype not in _INPUT_DTYPES:
        return f"{dtype} inputs"
    return _shape_reason(layer, inputs.shape.rank if hasattr(inputs.shape, "rank") else len(inputs.shape))


def last_call_reason(layer: keras.layers.Layer) -> Optional[str]:
    """Why `layer`'s last call (or trace) took Keras's path; ``""``: the fused kernel; None: no call while hooked."""
    return _last_call.get(layer)


def audit_note(layer: keras.layers.Layer) -> str:
    """``"fused"`` or ``"keras: <reason>"`` (the configuration's, else the last call's) for a BatchNormalization."""
    if not isinstance(layer, keras.layers.BatchNormalization):
        return ""
    why = layer_reason(layer) or _last_call.get(layer, "")
    return f"keras: {why}" if why else FUSED


def fused_call(layer: keras.layers.Layer, inputs: Any, training: Optional[bool]) -> tf.Tensor:
    """BatchNormalization's forward pass on ``FusedBatchNormV3``; updates the moving statistics in training."""
    rank = inputs.shape.rank
    axis = layer.axis % rank
    channels = inputs.shape[axis] or layer.moving_mean.shape[0]
    f32 = tf.float32
    scale = tf.cast(layer.gamma, f32) if layer.scale else tf.ones([channels], f32)
    offset = tf.cast(layer.beta, f32) if layer.center else tf.zeros([channels], f32)
    data_format = _FORMATS[(rank, axis == 1 and axis != rank - 1)]
    moving_mean = tf.cast(layer.moving_mean, f32)
    moving_variance = tf.cast(layer.moving_variance, f32)
    train = bool(training and layer.trainable)
    empty = tf.constant([], f32)
    y, mean, corrected, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=inputs, scale=scale, offset=offset, mean=empty if train else moving_mean,
        variance=empty if train else moving_variance, epsilon=layer.epsilon, exponential_avg_factor=1.0,
        data_format=data_format, is_training=train)
    if train:
        n = tf.cast(tf.size(inputs, out_type=tf.int64) // channels, f32)
        variance = corrected * (tf.maximum(n - 1.0, 1.0) / n)
        layer.moving_mean.assign(moving_mean * layer.momentum + mean * (1.0 - layer.momentum))
        layer.moving_variance.assign(
            moving_variance * layer.momentum + variance * (1.0 - layer.momentum))
    return tf.cast(y, layer.compute_dtype)


def _wrap(next_call: Callable) -> Callable:
    @functools.wraps(next_call)
    def call(self, inputs, training=None, mask=None):
        why = call_reason(self, inputs, training, mask)
        _last_call[self] = why
        if why == NOT_ATTACHED:
            return next_call(self, inputs, training=training, mask=mask)
        with step_state.kept_statistics(self, training):
            if why:
                return next_call(self, inputs, training=training, mask=mask)
            return fused_call(self, inputs, training)

    return call


def install() -> layer_calls.Hook:
    """Hooks ``keras.layers.BatchNormalization.call``; ``.remove()`` the returned `Hook` to undo."""
    return layer_calls.subscribe(keras.layers.BatchNormalization, "call", _wrap, owner="fused_batchnorm")
