"""Optional features whose Keras or TensorFlow surface is missing: off for the process, said once.

A feature not needed to train correctly (a speed-up, an exact-arithmetic fix) hooks a name a
release may move; where its hook fails to install, it is switched off with one warning and
tfmp goes on as plain Keras for that part.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional

from tfmp._src.errors import warn

#: What each optional feature does, for the warning.
FEATURES = {
    "gelu": "exact GELU in float32 inside (bfloat16 models on a CPU)",
    "conv": "float16 convolutions in float32 inside (float16 models on a CPU)",
    "cross_entropy": "sparse cross-entropy from 16-bit logits in two fused float32 passes (bfloat16 models on a CPU)",
    "bias_gradient": "bfloat16 bias gradients summed with float32 accumulation (CPU)",
    "dropout": "16-bit dropout drawing its noise in float32, so it drops its rate",
    "fused_batchnorm": "BatchNormalization on TensorFlow's fused kernel (mixed policies)",
    "fused_update": "Adam's and SGD's updates on TensorFlow's one-kernel ops",
    "gradient_errors": "backward-pass dtype mismatches explained, naming the layer",
    "build_errors": "dtype mismatches while a Functional model is built explained, naming the layer",
    "loaded_layers": "the sublayers of a float32 layer made in float32 when a model is loaded",
    "exact_layers": "Discretization, CategoryEncoding and Normalization made in float32 (exact)",
    "first_step": "the warning at fit about a model compiled before tfmp.enable()",
    "tflite_hint": "TFLite converter errors on a 16-bit model explained, naming tfmp.to_float32",
    "fused_projection": "chunked cross-entropies fused with the output projection (no whole logits)",
}

_off: Dict[str, str] = {}
_lock = threading.Lock()


def off(feature: str) -> Optional[str]:
    """Why `feature` is off in this process, or None while it is available."""
    with _lock:
        return _off.get(feature)


def switch_off(feature: str, error: BaseException) -> str:
    """Records `feature` (a key of `FEATURES`) as off for the process, warns once; returns the reason."""
    import keras
    import tensorflow as tf

    moved = f"Keras {keras.__version__} / TensorFlow {tf.__version__} moved what it hooks"
    detail = f"{type(error).__name__}: {error}"
    reason = f"{moved} ({detail})"
    with _lock:
        first = feature not in _off
        _off[feature] = reason
    if first:  # the error, of any length, below the three-line opening
        warn(f"tfmp turned one feature off in this process: {FEATURES[feature]}.",
             f"{moved}; that part works as under plain Keras.",
             "Fix: install the Keras and TensorFlow versions setup.cfg lists, or a tfmp release for this Keras.",
             UserWarning, section="a-feature-turned-off", details=f"What failed: {detail}")
    return reason


def clear() -> None:
    """Forgets what was switched off (tests)."""
    with _lock:
        _off.clear()
