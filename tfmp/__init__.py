"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras."""

from tfmp._custom_loop import scaled_gradients
from tfmp._dataset_check import check_dataset
from tfmp._errors import NonFiniteError
from tfmp._loss_scale import LossScaleOptimizer
from tfmp._numerics import check_numerics
from tfmp._version import __version__

__all__ = [
    "LossScaleOptimizer",
    "NonFiniteError",
    "check_dataset",
    "check_numerics",
    "scaled_gradients",
    "__version__",
]
