"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras.

    import tfmp
    tfmp.enable()        # policy chosen for this hardware
    model = build_model()
    model.compile("adam", loss=...)   # float32 forcing + loss-scale optimizer
    model.fit(ds, callbacks=[tfmp.LossScaleMonitor("logs/run1")])

`import tfmp` imports every public name below (and so TensorFlow and Keras,
checking their versions, and registering `LossScaleOptimizer` with Keras
serialization), except while Python starts ``python -m tfmp ...`` (the `tfmp`
command, see `_tfmp_command`): then the names are imported on first use (a module
``__getattr__``, PEP 562), so ``--help`` answers without TensorFlow's start-up
(about 6 s). Which module ``-m`` runs is read from ``sys.orig_argv``, the
interpreter's own command line, so a program started as ``python -m mypkg.train``
that imports tfmp gets everything at once.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, List, Optional

from tfmp._version import __version__ as __version__

# Public name -> the module that defines it (the one place each name is exported).
_EXPORTS = {
    "AuditReport": "tfmp._src.float32.audit_report",
    "NumericsHandle": "tfmp._src.numerics.check",
    "DatasetReport": "tfmp._src.numerics.dataset",
    "ExportReport": "tfmp._src.deployment.report",
    "Float32Rules": "tfmp._src.float32.registry",
    "Registration": "tfmp._src.float32.registry",
    "MetricSummary": "tfmp._src.advisors.compare_report",
    "Verdict": "tfmp._src.advisors.compare_report",
    "Attachment": "tfmp._src.attachment.record",
    "CompareReport": "tfmp._src.advisors.compare_report",
    "DeviceFacts": "tfmp._src.policy.hardware",
    "DoctorReport": "tfmp._src.advisors.doctor",
    "GpuFacts": "tfmp._src.policy.hardware",
    "LoggingWarning": "tfmp._src.monitor.event_file",
    "LossScaleMonitor": "tfmp._src.monitor.callback",
    "LossScaleOptimizer": "tfmp._src.loss_scale.optimizer",
    "LossScaleWarning": "tfmp._src.loss_scale.guard",
    "SkippedStepWarning": "tfmp._src.loss_scale.skips",
    "SpeedProbe": "tfmp._src.policy.speed_probe",
    "MemoryEstimate": "tfmp._src.advisors.memory",
    "NonFiniteError": "tfmp._src.errors",
    "PerformanceWarning": "tfmp._src.policy.policy",
    "PolicyDecision": "tfmp._src.policy.policy",
    "attachment": "tfmp._src.attachment.attach",
    "audit": "tfmp._src.float32.audit",
    "check_dataset": "tfmp._src.numerics.dataset",
    "check_numerics": "tfmp._src.numerics.check",
    "compare": "tfmp._src.advisors.compare",
    "detach": "tfmp._src.attachment.attach",
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


def _module_run_by_python(command_line: List[str]) -> Optional[str]:
    """The NAME of ``python [options] -m NAME ...`` (`sys.orig_argv`), or None.

    Options are read as CPython's command line defines them: single-letter flags
    may be grouped (``-Bm tfmp``, ``-mtfmp``); ``-W`` and ``-X`` take a value (in
    the same word or the next); ``-c``, ``--``, a script path or ``-`` end the options.
    """
    words = iter(command_line[1:])
    for word in words:
        if word == "--check-hash-based-pycs":
            next(words, None)
            continue
        if word == "--":
            return None  # a script path follows
        if word.startswith("--"):
            continue
        if not word.startswith("-") or word == "-":
            return None
        flags = word[1:]
        for position, flag in enumerate(flags):
            value = flags[position + 1:]
            if flag == "m":
                return value or next(words, None)
            if flag == "c":
                return None
            if flag in "WX":
                if not value:
                    next(words, None)
                break
    return None


if _module_run_by_python(list(getattr(sys, "orig_argv", []))) != "tfmp":
    _import_public_names()
