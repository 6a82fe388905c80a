"""tfmp: safe, fast and visible mixed-precision training for TensorFlow/Keras.

    import tfmp
    tfmp.enable()        # policy chosen for this hardware
    model = build_model()
    model.compile("adam", loss=...)   # float32 forcing + loss-scale optimizer
    model.fit(ds, callbacks=[tfmp.LossScaleMonitor("logs/run1")])

Each public name is defined in one private module under `tfmp/_src/` and imported
below as ``name as name`` (an explicit re-export for type checkers). Under ``python -m
tfmp`` (read from `sys.orig_argv`) they are imported on first use (PEP 562
``__getattr__``), so ``--help`` answers without TensorFlow's start-up.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, List, Optional

from tfmp._version import __version__ as __version__

__all__ = [
    "__version__",
    # Policy: choosing and setting the dtype policy
    "enable", "disable", "policy_scope", "recommend_policy", "PolicyDecision",
    "PerformanceWarning",
    # Float32 where 16 bits break numerics
    "force_float32", "register_float32", "unregister_float32", "float32_layers", "Float32Rules",
    "Registration", "audit", "AuditReport", "UnmatchedTargetWarning",
    # A language model's loss from 16-bit logits, float32 by chunks
    "ChunkedSparseCategoricalCrossentropy", "ChunkedCategoricalCrossentropy",
    # Loss scaling
    "LossScaleOptimizer", "scaled_gradients", "LossScaleWarning", "SkippedStepWarning",
    # Finding the first non-finite value
    "check_numerics", "NumericsHandle", "NonFiniteError", "check_dataset", "DatasetReport",
    # TensorBoard
    "LossScaleMonitor", "LoggingWarning",
    # What tfmp decided for one model
    "attachment", "detach", "step_scope", "Attachment",
    # Several worker processes
    "multi_worker_strategy",
    # Tooling, deployment: a float32 copy, SavedModel and TFLite
    "to_float32", "export", "ExportReport",
    # Tooling, advisors: the machine, a policy comparison, memory
    "doctor", "DoctorReport", "DeviceFacts", "GpuFacts", "SpeedProbe", "compare",
    "CompareReport", "MetricSummary", "Verdict", "estimate_memory", "estimate_kv_cache",
    "MemoryEstimate",
]


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


#: True while ``python -m tfmp`` starts and nothing public has been used yet.
_IMPORTS_DEFERRED = (not globals().get("_IMPORTING_ON_FIRST_USE", False)
                     and _module_run_by_python(list(getattr(sys, "orig_argv", []))) == "tfmp")

if not _IMPORTS_DEFERRED:
    from tfmp._src.policy.enable import enable as enable
    from tfmp._src.policy.enable import disable as disable
    from tfmp._src.policy.enable import policy_scope as policy_scope
    from tfmp._src.policy.policy import recommend_policy as recommend_policy
    from tfmp._src.policy.policy import PolicyDecision as PolicyDecision
    from tfmp._src.policy.policy import PerformanceWarning as PerformanceWarning
    from tfmp._src.float32.force import force_float32 as force_float32
    from tfmp._src.float32.registry import register_float32 as register_float32
    from tfmp._src.float32.registry import unregister_float32 as unregister_float32
    from tfmp._src.float32.registry import float32_layers as float32_layers
    from tfmp._src.float32.registry import Float32Rules as Float32Rules
    from tfmp._src.float32.registry import Registration as Registration
    from tfmp._src.float32.audit import audit as audit
    from tfmp._src.float32.audit_report import AuditReport as AuditReport
    from tfmp._src.float32.unmatched import UnmatchedTargetWarning as UnmatchedTargetWarning
    from tfmp._src.float32.chunked_losses import (
        ChunkedSparseCategoricalCrossentropy as ChunkedSparseCategoricalCrossentropy)
    from tfmp._src.float32.chunked_losses import ChunkedCategoricalCrossentropy as ChunkedCategoricalCrossentropy
    from tfmp._src.loss_scale.optimizer import LossScaleOptimizer as LossScaleOptimizer
    from tfmp._src.loss_scale.loops import scaled_gradients as scaled_gradients
    from tfmp._src.loss_scale.guard import LossScaleWarning as LossScaleWarning
    from tfmp._src.loss_scale.loops import SkippedStepWarning as SkippedStepWarning
    from tfmp._src.numerics.check import check_numerics as check_numerics
    from tfmp._src.numerics.check import NumericsHandle as NumericsHandle
    from tfmp._src.errors import NonFiniteError as NonFiniteError
    from tfmp._src.numerics.dataset import check_dataset as check_dataset
    from tfmp._src.numerics.dataset import DatasetReport as DatasetReport
    from tfmp._src.monitor.callback import LossScaleMonitor as LossScaleMonitor
    from tfmp._src.monitor.event_file import LoggingWarning as LoggingWarning
    from tfmp._src.attachment.attach import attachment as attachment
    from tfmp._src.attachment.attach import detach as detach
    from tfmp._src.attachment.attach import step_scope as step_scope
    from tfmp._src.attachment.record import Attachment as Attachment
    from tfmp._src.cluster import multi_worker_strategy as multi_worker_strategy
    from tfmp._src.deployment.to_float32 import to_float32 as to_float32
    from tfmp._src.deployment.export import export as export
    from tfmp._src.deployment.report import ExportReport as ExportReport
    from tfmp._src.advisors.doctor import doctor as doctor
    from tfmp._src.advisors.doctor import DoctorReport as DoctorReport
    from tfmp._src.policy.hardware import DeviceFacts as DeviceFacts
    from tfmp._src.policy.hardware import GpuFacts as GpuFacts
    from tfmp._src.policy.speed_probe import SpeedProbe as SpeedProbe
    from tfmp._src.advisors.compare import compare as compare
    from tfmp._src.advisors.compare_report import CompareReport as CompareReport
    from tfmp._src.advisors.compare_report import MetricSummary as MetricSummary
    from tfmp._src.advisors.compare_report import Verdict as Verdict
    from tfmp._src.advisors.memory import estimate_memory as estimate_memory
    from tfmp._src.advisors.memory import estimate_kv_cache as estimate_kv_cache
    from tfmp._src.advisors.memory import MemoryEstimate as MemoryEstimate


if not TYPE_CHECKING:  # a type checker sees the imports above, and no catch-all

    def __getattr__(name: str) -> Any:
        """Imports the public names on first use (``python -m tfmp``).

        Raises:
            AttributeError: `name` is not public, or the names are already imported.
        """
        if name not in __all__ or not _IMPORTS_DEFERRED:
            raise AttributeError(f"module 'tfmp' has no attribute {name!r}")
        globals()["_IMPORTING_ON_FIRST_USE"] = True
        importlib.reload(sys.modules[__name__])
        return globals()[name]


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
