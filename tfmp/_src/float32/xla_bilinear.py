"""16-bit bilinear ``UpSampling2D`` under XLA on the CPU: compiled without XLA, with a warning.

XLA's CPU compiler cannot train it (openxla/xla#43052: the resize's gradient comes out in
float32 and meets a 16-bit one). After Keras's ``compile``, `turn_off_xla_for_bilinear`
sets ``model.jit_compile = False`` and warns once; not when a GPU or TPU is visible.
"""

from __future__ import annotations

from typing import Any, List

import keras
import tensorflow as tf

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.errors import warn
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
    warn(f"tfmp compiled model {model.name!r} with jit_compile=False: XLA cannot train its {compute} bilinear resizes.",
         f"UpSampling2D(interpolation='bilinear') layers {paths}: XLA on the CPU refuses their gradient.",
         f"Fix: tfmp.enable(..., keep_float32={paths}) keeps XLA; jit_compile=False silences this.",
         PerformanceWarning, section="xla-turned-off")
    model.jit_compile = False
    return True
