"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras.

    import tfmp
    tfmp.enable()        # policy chosen for this hardware
    model = build_model()
    model.compile("adam", loss=...)   # float32 forcing + loss-scale optimizer
    model.fit(ds, callbacks=[tfmp.LossScaleMonitor("logs/run1")])
"""

from tfmp._audit import audit
from tfmp._compare import compare
from tfmp._compare_report import CompareReport
from tfmp._dataset_check import check_dataset
from tfmp._doctor import DoctorReport
from tfmp._doctor import doctor
from tfmp._enable import disable
from tfmp._enable import enable
from tfmp._enable import policy_scope
from tfmp._errors import NonFiniteError
from tfmp._float32 import force_float32
from tfmp._hardware import DeviceFacts
from tfmp._hardware import GpuFacts
from tfmp._loss_scale import LossScaleOptimizer
from tfmp._loss_scale_loops import scaled_gradients
from tfmp._memory import MemoryEstimate
from tfmp._memory import estimate_kv_cache
from tfmp._memory import estimate_memory
from tfmp._monitor import LossScaleMonitor
from tfmp._numerics import check_numerics
from tfmp._policy import PerformanceWarning
from tfmp._policy import PolicyDecision
from tfmp._policy import recommend_policy
from tfmp._registry import float32_layers
from tfmp._registry import register_float32
from tfmp._registry import unregister_float32
from tfmp._version import __version__

__all__ = [
    "CompareReport",
    "DeviceFacts",
    "DoctorReport",
    "GpuFacts",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "MemoryEstimate",
    "NonFiniteError",
    "PerformanceWarning",
    "PolicyDecision",
    "__version__",
    "audit",
    "check_dataset",
    "check_numerics",
    "compare",
    "disable",
    "doctor",
    "enable",
    "estimate_kv_cache",
    "estimate_memory",
    "float32_layers",
    "force_float32",
    "policy_scope",
    "recommend_policy",
    "register_float32",
    "scaled_gradients",
    "unregister_float32",
]
