"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras.

    import tfmp
    tfmp.enable()        # policy chosen for this hardware
    model = build_model()
    model.compile("adam", loss=...)   # float32 forcing + loss-scale optimizer
    model.fit(ds, callbacks=[tfmp.LossScaleMonitor("logs/run1")])

`import tfmp` imports every public name below (and so TensorFlow and Keras,
checking their versions, and registering `LossScaleOptimizer` with Keras
serialization), except while Python starts the `tfmp` command (``tfmp ...`` or
``python -m tfmp ...``): then the names are imported on first use (a module
``__getattr__``, PEP 562), so ``--help`` answers without TensorFlow's start-up
(about 6 s).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, List

from tfmp._version import __version__ as __version__

# Public name -> the module that defines it (the one place each name is exported).
_EXPORTS = {
    "CompareReport": "tfmp._src.advisors.compare_report",
    "DeviceFacts": "tfmp._src.policy.hardware",
    "DoctorReport": "tfmp._src.advisors.doctor",
    "GpuFacts": "tfmp._src.policy.hardware",
    "LossScaleMonitor": "tfmp._src.monitor.callback",
    "LossScaleOptimizer": "tfmp._src.loss_scale.optimizer",
    "LossScaleWarning": "tfmp._src.loss_scale.guard",
    "MemoryEstimate": "tfmp._src.advisors.memory",
    "NonFiniteError": "tfmp._src.errors",
    "PerformanceWarning": "tfmp._src.policy.policy",
    "PolicyDecision": "tfmp._src.policy.policy",
    "audit": "tfmp._src.float32.audit",
    "check_dataset": "tfmp._src.numerics.dataset",
    "check_numerics": "tfmp._src.numerics.check",
    "compare": "tfmp._src.advisors.compare",
    "disable": "tfmp._src.policy.enable",
    "doctor": "tfmp._src.advisors.doctor",
    "enable": "tfmp._src.policy.enable",
    "estimate_kv_cache": "tfmp._src.advisors.memory",
    "estimate_memory": "tfmp._src.advisors.memory",
    "export": "tfmp._src.deployment.export",
    "float32_layers": "tfmp._src.float32.registry",
    "force_float32": "tfmp._src.float32.force",
    "policy_scope": "tfmp._src.policy.enable",
    "recommend_policy": "tfmp._src.policy.policy",
    "register_float32": "tfmp._src.float32.registry",
    "scaled_gradients": "tfmp._src.loss_scale.loops",
    "to_float32": "tfmp._src.deployment.to_float32",
    "unregister_float32": "tfmp._src.float32.registry",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def _import_public_names() -> None:
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    """Imports the public names on first use; other names raise AttributeError."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tfmp' has no attribute {name!r}")
    _import_public_names()
    return globals()[name]


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))


def _starting_the_command_line() -> bool:
    """True while Python starts the `tfmp` command rather than a program importing tfmp.

    ``python -m tfmp`` imports this package while ``sys.argv[0]`` is still ``"-m"``
    (Python's documentation of ``-m``); the console script setup.cfg installs is
    named ``tfmp`` (``tfmp.exe`` or ``tfmp-script.py`` on Windows).
    """
    argv = getattr(sys, "argv", None) or [""]
    name = os.path.basename(argv[0]).split(".")[0]
    return argv[0] == "-m" or name in ("tfmp", "tfmp-script")


if not _starting_the_command_line():
    _import_public_names()
