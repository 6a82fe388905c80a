"""What the float32-inside rules share (`gelu.py`, `conv.py`): the per-model decision and the calling layer's.

A model computing in a 16-bit dtype whose CPU kernels for an op are the slow path
computes that op in float32 inside and rounds once to the 16-bit dtype. Whether
it does is decided once, when tfmp attaches the model, from facts that do not
move (the compute dtype, whether a GPU or TPU runs the steps), and kept in one
field of its `Attachment`; a hooked op asks the attachment of the layer computing
it.
"""

from __future__ import annotations

from typing import Optional

from tfmp._src.attachment import record
from tfmp._src.keras_hooks import availability, layer_calls
from tfmp._src.policy.hardware import DeviceFacts, detect_device_facts

#: An `Attachment` field's value (before the colon) for an op computed in float32 inside.
FLOAT32_INSIDE = "float32 inside"
#: An `Attachment` field's value for an op left as Keras computes it.
KERAS = "keras"


def decided(feature: str, compute_dtype: str, dtype: str, rule: str, facts: Optional[DeviceFacts]) -> str:
    """The `Attachment` field for a model computing in `compute_dtype`.

    Args:
        feature: String. The feature's name in `availability.FEATURES` (and its
            `Attachment` field).
        compute_dtype: String. The model's compute dtype.
        dtype: String. The one compute dtype the rule changes.
        rule: String. Why, quoted after ``"float32 inside: "``.
        facts: `DeviceFacts` or None (this machine's, `detect_device_facts`). With
            a GPU or TPU Keras's op is kept.

    Returns:
        String: `KERAS`, ``"keras: off, <why>"`` where the feature's Keras surface
        is missing in this process, or ``"float32 inside: "`` + `rule`.
    """
    if compute_dtype != dtype:
        return KERAS
    missing = availability.off(feature)
    if missing:
        return f"{KERAS}: off, {missing}"
    facts = facts if facts is not None else detect_device_facts()
    if facts.gpus or facts.tpu:
        return KERAS
    return f"{FLOAT32_INSIDE}: {rule}"


def calling_layer_takes(field: str) -> bool:
    """Bool. The layer whose call is running (`layer_calls.calling_layer`) is attached
    with `field` (an `Attachment` field name) starting with `FLOAT32_INSIDE`: its own
    model's decision, also inside a model tfmp did not attach; not after `tfmp.detach`."""
    found = record.of_calling(layer_calls.calling_layer())
    return found is not None and getattr(found, field).startswith(FLOAT32_INSIDE)
