"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras."""

from tfmp._errors import NonFiniteError
from tfmp._version import __version__

__all__ = [
    "NonFiniteError",
    "__version__",
]
