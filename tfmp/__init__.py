"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras."""

from tfmp._custom_loop import scaled_gradients
from tfmp._errors import NonFiniteError
from tfmp._loss_scale import LossScaleOptimizer
from tfmp._version import __version__

__all__ = [
    "LossScaleOptimizer",
    "NonFiniteError",
    "scaled_gradients",
    "__version__",
]
