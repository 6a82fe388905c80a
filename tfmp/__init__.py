"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras."""

from tfmp._compare import compare
from tfmp._compare_report import CompareReport
from tfmp._doctor import DoctorReport
from tfmp._doctor import doctor
from tfmp._errors import NonFiniteError
from tfmp._memory import MemoryEstimate
from tfmp._memory import estimate_kv_cache
from tfmp._memory import estimate_memory
from tfmp._version import __version__

__all__ = [
    "CompareReport",
    "DoctorReport",
    "MemoryEstimate",
    "NonFiniteError",
    "__version__",
    "compare",
    "doctor",
    "estimate_kv_cache",
    "estimate_memory",
]
