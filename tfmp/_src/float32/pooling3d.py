"""float16 3-D pooling layers forced to float32 on machines without a GPU or TPU.

TensorFlow 2.21 registers no float16 CPU kernel for ``MaxPool3D`` or ``AvgPool3D``, so
under plain Keras ``mixed_float16`` these layers fail at their first call on a CPU. `reason`
is a built-in rule of `registry.builtin_reason`; a user exclusion is refused (`excluded_error`).
"""

from __future__ import annotations

from typing import Optional

import keras

from tfmp._src.errors import invalid_argument
from tfmp._src.policy.hardware import detect_device_facts

#: The Keras layers whose TensorFlow op has no float16 CPU kernel.
CLASSES = (keras.layers.MaxPooling3D, keras.layers.AveragePooling3D)
#: The reason `tfmp.audit` shows for a forced one.
REASON = "float16 3-D pooling on a CPU (TensorFlow has no float16 MaxPool3D/AvgPool3D CPU kernel)"


def reason(layer: keras.layers.Layer) -> Optional[str]:
    """`REASON` for a float16 `CLASSES` layer on a machine without GPUs or TPUs, else None.

    A float32 layer gets `REASON` too, so a forced layer is recognised when loaded.
    """
    if not isinstance(layer, CLASSES) or layer.compute_dtype not in ("float16", "float32"):
        return None
    facts = detect_device_facts()
    return None if facts.gpus or facts.tpu else REASON


def excluded_error(path: str, layer: keras.layers.Layer) -> ValueError:
    """The ValueError to raise for a float16 `CLASSES` layer at ``path`` an exclusion keeps out of float32."""
    cls = type(layer).__name__
    return invalid_argument(
        "exclude", path,
        f"no float16 {cls} excluded from float32 on a machine without GPUs or TPUs: TensorFlow has "
        f"no float16 CPU kernel for its op, so its first call would fail ('Could not find device "
        f"for node' / 'No OpKernel was registered')",
        fix=f"Take the target matching '{path}' out of exclude= / exclude_float32= / "
        f"tfmp.register_float32(..., exclude=True), so that tfmp computes it in float32, or create "
        f"it with {cls}(..., dtype=\"float32\").")
