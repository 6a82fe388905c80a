"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras."""

from tfmp._audit import audit
from tfmp._errors import NonFiniteError
from tfmp._float32 import force_float32
from tfmp._registry import float32_layers
from tfmp._registry import register_float32
from tfmp._registry import unregister_float32
from tfmp._version import __version__

__all__ = [
    "NonFiniteError",
    "audit",
    "float32_layers",
    "force_float32",
    "register_float32",
    "unregister_float32",
    "__version__",
]
