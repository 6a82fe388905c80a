"""16-bit bilinear ``UpSampling2D`` under XLA on the CPU: compiled without XLA, with a warning.

XLA's CPU compiler cannot train it (openxla/xla#43052: the resize's gradient comes out in
float32 and meets a 16-bit one). After Keras's ``compile``, `turn_off_xla_for_bilinear`
sets ``model.jit_compile = False`` and warns once; not when a GPU or TPU is visible.
"""

from __future__ import annotations

import warnings
from typing import Any, List

import keras
import tensorflow as tf

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.errors import user_stacklevel
from tfmp._src.layer_tree import walk
from tfmp._src.policy.policy import PerformanceWarning


def bilinear_16bit_layers(model: Any) -> List[str]:
    """Paths of `model`'s ``UpSampling2D(interpolation="bilinear")`` layers computing in 16 bits."""
    return [entry.path for entry in walk(model)
            if isinstance(entry.layer, keras.layers.UpSampling2D)
            and entry.layer.interpolation == "bilinear"
            and entry.layer.compute_dtype in LOW_PRECISION]


def turn_off_xla_for_bilinear(model: keras.Model) -> bool:
    """Switches `model.jit_compile` off when XLA on the CPU cannot train its 16-bit bilinear resizes.

    Returns True when it did, with a `tfmp.PerformanceWarning` naming the layers and both fixes.
    """
    if model.jit_compile is not True or any(d.device_type != "CPU" for d in tf.config.list_physical_devices()):
        return False
    paths = bilinear_16bit_layers(model)
    if not paths:
        return False
    compute = model.dtype_policy.compute_dtype
    warnings.warn(
        f"XLA (jit_compile=True) on the CPU cannot train {compute} "
        f"UpSampling2D(interpolation='bilinear') layers {paths} of model {model.name!r}: "
        f"the resize's gradient comes out in float32 and meets the {compute} gradient of "
        "the op before it, and XLA stops the first step with 'Seen floating point types "
        "of different precisions ... but mixed precision is disallowed' "
        f"(openxla/xla#43052). tfmp compiled the model with jit_compile=False instead; "
        f"the step runs as a tf.function graph. To keep XLA, compute these layers in "
        f"float32: tfmp.enable(..., keep_float32={paths}); to compile without XLA and "
        "without this warning, pass jit_compile=False.",
        PerformanceWarning,
        stacklevel=user_stacklevel(),  # the caller of Model.compile
    )
    model.jit_compile = False
    return True
