"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras.

    import tfmp
    tfmp.enable()        # policy chosen for this hardware
    model = build_model()
    model.compile("adam", loss=...)   # float32 forcing + loss-scale optimizer
    model.fit(ds, callbacks=[tfmp.LossScaleMonitor("logs/run1")])
"""

from tfmp._src.float32.audit import audit
from tfmp._src.advisors.compare import compare
from tfmp._src.advisors.compare_report import CompareReport
from tfmp._src.numerics.dataset import check_dataset
from tfmp._src.deployment.export import export
from tfmp._src.deployment.to_float32 import to_float32
from tfmp._src.advisors.doctor import DoctorReport
from tfmp._src.advisors.doctor import doctor
from tfmp._src.policy.enable import disable
from tfmp._src.policy.enable import enable
from tfmp._src.policy.enable import policy_scope
from tfmp._src.errors import NonFiniteError
from tfmp._src.float32.force import force_float32
from tfmp._src.policy.hardware import DeviceFacts
from tfmp._src.policy.hardware import GpuFacts
from tfmp._src.loss_scale.optimizer import LossScaleOptimizer
from tfmp._src.loss_scale.guard import LossScaleWarning
from tfmp._src.loss_scale.loops import scaled_gradients
from tfmp._src.advisors.memory import MemoryEstimate
from tfmp._src.advisors.memory import estimate_kv_cache
from tfmp._src.advisors.memory import estimate_memory
from tfmp._src.monitor.callback import LossScaleMonitor
from tfmp._src.numerics.check import check_numerics
from tfmp._src.policy.policy import PerformanceWarning
from tfmp._src.policy.policy import PolicyDecision
from tfmp._src.policy.policy import recommend_policy
from tfmp._src.float32.registry import float32_layers
from tfmp._src.float32.registry import register_float32
from tfmp._src.float32.registry import unregister_float32
from tfmp._version import __version__

__all__ = [
    "CompareReport",
    "DeviceFacts",
    "DoctorReport",
    "GpuFacts",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "LossScaleWarning",
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
    "export",
    "float32_layers",
    "force_float32",
    "policy_scope",
    "recommend_policy",
    "register_float32",
    "scaled_gradients",
    "to_float32",
    "unregister_float32",
]
