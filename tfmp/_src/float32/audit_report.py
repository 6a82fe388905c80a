"""The result of `tfmp.audit` (built by `tfmp._src.float32.audit`): its data classes and table."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from tfmp._src.errors import check_type, invalid_argument
from tfmp._src.float32 import fused_batchnorm as _fused_batchnorm


#: The table's first line names the policy by its source (`AuditReport.policy_source`).
POLICY_LABELS = {
    "attachment": "policy tfmp attached the model under",
    "enable": "policy of tfmp.enable()",
    "model": "model policy",
}


@dataclasses.dataclass(frozen=True)
class AuditWarning:
    """One finding. ``kind`` is one of those listed at `AuditReport.warnings`; ``path`` the layer."""

    kind: str
    path: str
    message: str


@dataclasses.dataclass(frozen=True)
class AuditRow:
    """One layer.

    Attributes:
        path: String. Layer path relative to the model (``"block/dense"``).
        class_name: String. The layer's class name.
        compute_dtype: String. Dtype the layer computes in.
        output_dtype: String. Dtype(s) of its floating outputs, comma-separated;
            ``"-"`` when it never ran in the ``batch=`` pass.
        variable_dtype: String. Dtype of its own weights (else its policy's).
        forced: String. tfmp's reason for forcing it to float32 (``"output"``,
            ``"softmax"``, ``"known fix: ..."``, ``"user rule"``, ``"inside <path>"``...)
            or ``""``; ``"output cast to float32 (body 16-bit)"`` for a block
            producing a model output, computing in 16 bits.
        why: String. ``forced``, or ``"float32 inside Keras >= 3.12"`` for a layer
            Keras itself computes in float32, or ``"float32 inside tfmp (Attachment.conv)"``
            (``depthwise_conv``) for a float16 convolution tfmp computes in float32 inside,
            or ``""``.
        params: Int. Its own parameter count.
        warnings: Tuple of warning kinds for this layer.
        output_from: String. Where ``output_dtype`` comes from: ``"graph"``,
            ``"run"`` (the ``batch=`` pass) or ``"rule"``.
        batchnorm_kernel: String. ``"fused"`` or ``"keras: <why not>"`` for a
            BatchNormalization (`tfmp._src.float32.fused_batchnorm`), else ``""``.
    """

    path: str
    class_name: str
    compute_dtype: str
    output_dtype: str
    variable_dtype: str
    forced: str
    why: str
    params: int
    warnings: Tuple[str, ...]
    output_from: str
    batchnorm_kernel: str = ""


@dataclasses.dataclass(frozen=True)
class GradientRow:
    """A trainable variable's dtype and its gradient's dtype (None: no gradient)."""

    path: str
    variable_dtype: str
    gradient_dtype: Optional[str]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Result of :func:`audit`; ``str(report)`` is an aligned table.

    Attributes:
        policy: String. Name of the dtype policy the model's layers are checked
            against (``policy_mismatch``), from `policy_source`.
        rows: Tuple of :class:`AuditRow`, parents before children.
        warnings: Tuple of :class:`AuditWarning`, of kinds ``sensitive_16bit`` (a
            layer a registry rule keeps in float32 computes in 16 bits, not by
            exclusion); ``output_16bit`` (a model output's layer, or with
            ``batch=`` an output at run time, is 16-bit); ``variables_16bit`` (no
            float32 master weights); ``policy_mismatch`` (a policy tfmp did not
            set differs from the expected one); ``tensor_core_dims`` (on a Tensor
            Core GPU, a 16-bit Dense/Conv dimension or the batch size is not a
            multiple of 8, NVIDIA "Train With Mixed Precision"); ``float32_heavy``
            (over half the multiplied parameters run in float32); ``consumer_dtype``
            (a forced layer's output dtype differs from its consumer's);
            ``dtype_mismatch`` (``batch=`` pass failed on two dtypes in one op).
        float32_fraction: Float in [0, 1]. Share of the parameters multiplied per
            example (not an ``Embedding`` table only looked up) that are
            multiplied in float32: in forced layers (not cast-only outputs) or in
            a tied projection Keras runs in float32 (`tfmp._src.float32.audit_cost`).
        gradients: Tuple of :class:`GradientRow`, empty unless ``batch`` was given.
        policy_source: String. Where `policy` comes from: ``"attachment"``
            (`tfmp.attachment`), ``"enable"`` (this thread's `tfmp.enable()`) or
            ``"model"`` (its own ``dtype_policy``); never Keras's global policy.
    """

    policy: str
    rows: Tuple[AuditRow, ...]
    warnings: Tuple[AuditWarning, ...]
    float32_fraction: float
    gradients: Tuple[GradientRow, ...] = ()
    policy_source: str = "model"

    def __post_init__(self) -> None:
        """Checks the fields, so a report made by hand fails here, not when printed.

        Raises:
            ValueError: a field of another type, `float32_fraction` outside [0, 1]
                or `policy_source` not a key of `POLICY_LABELS`.
        """
        check_type("policy", self.policy, str, "a dtype policy name string", fix="Pass e.g. policy='mixed_float16'.")
        for name, kind in (("rows", AuditRow), ("warnings", AuditWarning), ("gradients", GradientRow)):
            check_type(name, getattr(self, name), tuple, f"a tuple of {kind.__name__}", items=kind,
                       fix=f"Pass e.g. {name}=() or a tuple of {kind.__name__}, as tfmp.audit(model).{name} holds.")
        fraction = self.float32_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise invalid_argument("float32_fraction", fraction, "a number in [0, 1]",
                                   fix="Pass the share of parameters in forced layers, e.g. float32_fraction=0.25.")
        if not isinstance(self.policy_source, str) or self.policy_source not in POLICY_LABELS:
            raise invalid_argument("policy_source", self.policy_source,
                                   "one of " + ", ".join(map(repr, POLICY_LABELS)), choices=POLICY_LABELS,
                                   fix="Pass e.g. policy_source='model' (the default).")

    @property
    def kinds(self) -> frozenset:
        """Set of warning kinds present."""
        return frozenset(w.kind for w in self.warnings)

    def __str__(self) -> str:
        header = ("layer", "class", "compute", "output", "variables", "why", "params", "warnings")
        body = [
            (r.path, r.class_name, r.compute_dtype,
             r.output_dtype + ("*" if r.output_from == "rule" else ""), r.variable_dtype,
             r.why or "-", f"{r.params:,}", ",".join(r.warnings) or "-")
            for r in self.rows
        ]
        lines = [f"tfmp audit ({POLICY_LABELS[self.policy_source]}: {self.policy})"] + _table(header, body)
        if any(r.output_from == "rule" for r in self.rows):
            lines.append("* output dtype from tfmp's rule (layer inside custom code); "
                         "pass batch= to measure it.")
        lines.append(f"Parameters multiplied in float32: {self.float32_fraction:.1%} (forced layers, "
                     "tied projections; embedding lookups not counted)")
        lines += _batchnorm_lines(self.rows)
        if self.gradients:
            lines += ["", "Gradient check (one batch):"] + _table(
                ("variable", "variable dtype", "gradient dtype"),
                [(g.path, g.variable_dtype, g.gradient_dtype or "None") for g in self.gradients],
            )
        lines += [""] + [f"WARNING [{w.kind}] {w.message}" for w in self.warnings]
        return "\n".join(lines).rstrip()


def _batchnorm_lines(rows: Sequence[AuditRow]) -> List[str]:
    """One line counting the fused BatchNormalization layers, one per layer on Keras's path."""
    notes = [(r.path, r.batchnorm_kernel) for r in rows if r.batchnorm_kernel]
    if not notes:
        return []
    fused = sum(note == _fused_batchnorm.FUSED for _, note in notes)
    return [f"BatchNormalization on the fused kernel: {fused} of {len(notes)}"] + [
        f"  {path}: {note}" for path, note in notes if note != _fused_batchnorm.FUSED]


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> List[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *body)]
    rule = "  ".join("-" * w for w in widths)

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()

    return [fmt(header), rule] + [fmt(row) for row in body]
