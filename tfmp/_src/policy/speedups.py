"""One switch for tfmp's speed features: ``tfmp.enable(speedups=...)``.

Speed features change which kernels compute a step, never what a model means. They
were measured on CPUs only (``benchmarks/``), so with a GPU or TPU each keeps Keras's
path. What a model got is decided when tfmp attaches it (``tfmp.attachment(model).speedups``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from tfmp._src.errors import did_you_mean, invalid_argument
from tfmp._src.keras_hooks import availability
from tfmp._src.policy import session
from tfmp._src.policy.hardware import DeviceFacts, detect_device_facts

#: Each speed feature -> what it does (and the `Attachment` field that shows it).
FEATURES = {
    "fused_batchnorm": "BatchNormalization of a mixed policy on TensorFlow's FusedBatchNormV3 "
                       "(Attachment.batchnorm_kernel; float32/fused_batchnorm.py)",
    "gelu": "a bfloat16 model's exact GELU computed in float32 inside on a CPU (Attachment.gelu; float32/gelu.py)",
    "conv": ("a float16 model's convolutions computed in float32 inside on a CPU (Attachment.conv, "
             "Attachment.depthwise_conv; float32/conv.py)"),
    "cross_entropy": "a bfloat16 model's from-logits sparse cross-entropy read from its 16-bit logits in two "
                     "fused float32 passes on a CPU, fused with the output projection above 1 GiB of logits "
                     "(Attachment.cross_entropy; float32/cross_entropy.py)",
    "remapper": "a float16 model's steps without Grappler's remapper where the CPU's oneDNN takes float16 "
                "(Attachment.remapper; policy/float16_fusion.py)",
    "fused_update": "Adam's and SGD's updates on TensorFlow's fused training kernels "
                    "(tfmp.LossScaleOptimizer.fused_updates; policy/fused_update.py)",
}
ON = "on"
#: Why a feature is off: the user's switch, or a device it was not measured on.
OFF_BY_SWITCH = "off (tfmp.enable(speedups=...))"
OFF_ON_ACCELERATOR = "off (a GPU or TPU runs the steps; measured on CPUs only)"


def checked_speedups(speedups: Any) -> Dict[str, bool]:
    """The full feature -> wanted map of ``enable(speedups=...)`` (features a dict does not name stay on).

    Raises:
        ValueError: (template) neither a bool nor such a dict; an unknown name
            (the names are listed) or a value that is not a bool.
    """
    if isinstance(speedups, bool):
        return dict.fromkeys(FEATURES, speedups)
    fix = ("Pass speedups=True (default), speedups=False, or a dict such as "
           "speedups={'fused_update': False}.")
    if not isinstance(speedups, dict):
        raise invalid_argument("speedups", speedups, "a bool or a dict of feature name -> bool", fix=fix)
    for name, wanted in speedups.items():
        if name not in FEATURES:
            close = did_you_mean(name, FEATURES)
            raise invalid_argument("speedups", speedups, "feature names among " + ", ".join(FEATURES),
                                   fix=f"{close} {fix}" if close else fix)
        if not isinstance(wanted, bool):
            raise invalid_argument("speedups", speedups, f"a bool for {name!r}", fix=fix)
    return {**dict.fromkeys(FEATURES, True), **speedups}


def decided(wanted: Optional[Dict[str, bool]], facts: Optional[DeviceFacts] = None) -> Dict[str, str]:
    """Feature -> ``"on"`` or ``"off (<why>)"`` for a model attached now.

    Why off, first found first: the switch (`wanted`; None wants every one); the
    feature's Keras surface is missing (`keras_hooks.availability`); a GPU or TPU.
    """
    facts = facts if facts is not None else detect_device_facts()
    measured = not (facts.gpus or facts.tpu)  # the speed features were measured on CPUs

    def one(name: str) -> str:
        if wanted is not None and not wanted[name]:
            return OFF_BY_SWITCH
        missing = availability.off(name) if name in availability.FEATURES else None
        if missing:
            return f"off ({missing})"
        return ON if measured else OFF_ON_ACCELERATOR

    return {name: one(name) for name in FEATURES}


def off_reason(value: str) -> str:
    """Why a feature's own field shows Keras's path, for a `decided` value that is not `ON`."""
    return f"speed-up {value}"


def keras_field(value: str) -> str:
    """A feature field's value (gelu, conv, a BatchNormalization's kernel) where the feature is off for `value`."""
    return f"keras: {off_reason(value)}"


#: A feature field's value (gelu, conv) for a model whose feature the switch turned off.
KERAS_BY_SWITCH = keras_field(OFF_BY_SWITCH)


def on_now(name: str) -> bool:
    """Bool. Feature `name` is on for what is made now: measured here, its Keras surface
    in place, and not switched off by the calling thread's session (`tfmp.enable`)."""
    current = session.current()
    return decided(current.speedups if current is not None else None)[name] == ON


def off(name: str, decisions: Dict[str, str]) -> str:
    """``""`` where feature `name` is on in `decisions` (an `Attachment.speedups`), else why it is off."""
    value = decisions.get(name, ON)
    return "" if value == ON else value
