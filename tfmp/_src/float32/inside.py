"""What the float32-inside rules (`gelu.py`, `conv.py`, `cross_entropy.py`) share: the per-model decision,
the calling layer's or stepping model's, and their XLA-compiled functions.

The decision is made once, when tfmp attaches the model, from facts that do not move (the
compute dtype, whether a GPU or TPU runs the steps), and kept in an `Attachment` field.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from tfmp._src.attachment import record
from tfmp._src.keras_hooks import availability, layer_calls
from tfmp._src.policy.hardware import DeviceFacts, detect_device_facts

#: An `Attachment` field's value (before the colon) for an op computed in float32 inside.
FLOAT32_INSIDE = "float32 inside"
#: An `Attachment` field's value for an op left as Keras computes it.
KERAS = "keras"


def decided(feature: str, compute_dtype: str, dtype: str, rule: str, facts: Optional[DeviceFacts]) -> str:
    """The `Attachment` field for a model computing in `compute_dtype`.

    ``"float32 inside: "`` + `rule` when `compute_dtype` is `dtype`, else as `kept_as_keras`.
    """
    return kept_as_keras(feature, compute_dtype == dtype, facts) or f"{FLOAT32_INSIDE}: {rule}"


def kept_as_keras(feature: str, applies: bool, facts: Optional[DeviceFacts]) -> str:
    """The `Attachment` field when `feature` keeps Keras's op, else ``""``.

    `KERAS` unless it `applies` and ``facts`` (None: this machine's) show no GPU
    or TPU; ``"keras: off, <why>"`` where `feature`'s Keras surface is missing.
    """
    if not applies:
        return KERAS
    missing = availability.off(feature)
    if missing:
        return f"{KERAS}: off, {missing}"
    facts = facts if facts is not None else detect_device_facts()
    return KERAS if facts.gpus or facts.tpu else ""


def calling_layer_takes(field: str) -> bool:
    """Bool. The calling layer's model is attached with `field` starting with `FLOAT32_INSIDE`."""
    found = record.of_calling(layer_calls.calling_layer())
    return found is not None and getattr(found, field).startswith(FLOAT32_INSIDE)


@functools.lru_cache(maxsize=None)
def xla_compiled(function: Callable) -> Callable:
    """`function` as one XLA-compiled `tf.function` (its ops fused in one loop, compiled per shape), made once."""
    import tensorflow as tf

    return tf.function(function, jit_compile=True, autograph=False, reduce_retracing=True)


def stepping_model_takes(field: str) -> bool:
    """Bool. The model whose step this thread traces (`record.of_stepping`) has `field` starting with `FLOAT32_INSIDE`."""
    found = record.of_stepping()
    return found is not None and getattr(found, field).startswith(FLOAT32_INSIDE)
