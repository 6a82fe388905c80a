"""float16 3-D pooling layers forced to float32 on machines without a GPU or TPU.

TensorFlow 2.21 registers no float16 CPU kernel for ``MaxPool3D`` or ``AvgPool3D``
(float16 only on GPUs and under XLA), so under plain Keras ``mixed_float16`` a
``MaxPooling3D`` or ``AveragePooling3D`` fails at its first call on a CPU with a bare
"Could not find device" or "No OpKernel was registered" error; bfloat16, GPUs and TPUs
keep Keras's pooling. `reason` is a built-in rule of
`tfmp._src.float32.registry.builtin_reason`: the layer computes in float32 and hands
float16 back (the exact maximum; the mean rounded once), and the float32 policy is saved,
so the file runs in plain Keras too. A user exclusion is refused at once (`excluded_error`).
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

    Args:
        layer: ``keras.layers.Layer``.

    Returns:
        `REASON` or None. A float32 layer also gets `REASON` (when tfmp forced it
        before its model was saved, loading it back recognises it: see
        `tfmp._src.float32.force`); under bfloat16, or with a GPU or TPU
        (`detect_device_facts`), None.
    """
    if not isinstance(layer, CLASSES) or layer.compute_dtype not in ("float16", "float32"):
        return None
    facts = detect_device_facts()
    return None if facts.gpus or facts.tpu else REASON


def excluded_error(path: str, layer: keras.layers.Layer) -> ValueError:
    """The template error for a float16 `CLASSES` layer an exclusion keeps out of float32 on a CPU.

    Args:
        path: String. The layer's path in its model, e.g. ``"encoder/pool"``.
        layer: ``keras.layers.Layer``, for its class name.

    Returns:
        ValueError, to be raised by the caller (`tfmp._src.float32.force`).
    """
    cls = type(layer).__name__
    return invalid_argument(
        "exclude", path,
        f"no float16 {cls} excluded from float32 on a machine without GPUs or TPUs: TensorFlow has "
        f"no float16 CPU kernel for its op, so its first call would fail ('Could not find device "
        f"for node' / 'No OpKernel was registered')",
        fix=f"Take the target matching '{path}' out of exclude= / exclude_float32= / "
        f"tfmp.register_float32(..., exclude=True), so that tfmp computes it in float32, or create "
        f"it with {cls}(..., dtype=\"float32\").")
