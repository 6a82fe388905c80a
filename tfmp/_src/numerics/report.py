"""Turns the failure recorded by `FailureRecorder` into a `tfmp.NonFiniteError`.

Runs on the host between train steps; only reads variables. Number sources: float16's
largest finite value is 65504 and its smallest subnormal 2**-24 (about 6e-8), IEEE
754 binary16.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from tfmp._src.errors import NonFiniteError
from tfmp._src.constants import FLOAT16_MAX, NON_FINITE_KINDS
from tfmp._src.numerics.record import (
    ABS_MAX,
    ABS_MIN,
    BAD_GRADS,
    FORWARD,
    HAS_INPUT,
    IN_MAX,
    IN_MIN,
    INDEX,
    KIND,
    LOSS_ENTRY,
    PHASE,
    STEP,
    VALID,
    FailureRecorder,
)



def _kind(*values: float) -> Optional[str]:
    """"nan", "inf", "nan+inf" or None for finite `values` (a range: NaN/inf propagate)."""
    array = np.asarray(values, dtype=np.float64)
    return NON_FINITE_KINDS.get(int(np.isnan(array).any()) + 2 * int(np.isinf(array).any()))


def _trace(recorder: FailureRecorder, begin: int, step: int) -> list[dict]:
    """The window rows as dicts, oldest first; rows before the step come from earlier steps."""
    names, rows = recorder.names, recorder.window.numpy()
    count, trace = len(names), []
    for offset, row in enumerate(rows):
        position = begin - len(rows) + offset
        if row[VALID] == 0 or count == 0:
            continue
        path, layer_class, dtype = names[position % count]
        trace.append(
            {
                "step": step + position // count,
                "layer": path,
                "layer_class": layer_class,
                "dtype": dtype,
                "abs_min": float(row[ABS_MIN]),
                "abs_max": float(row[ABS_MAX]),
                "kind": _kind(row[ABS_MIN], row[ABS_MAX]),
                "input_kind": _kind(row[IN_MIN], row[IN_MAX]) if row[HAS_INPUT] else None,
                "input_range": (float(row[IN_MIN]), float(row[IN_MAX])) if row[HAS_INPUT] else None,
            }
        )
    return trace


def format_trace(trace: list[dict]) -> str:
    """One line per trace entry: step, layer path, class, |output| range, kind."""
    if not trace:
        return ""
    width = max(len(item["layer"]) for item in trace)
    lines = [f"Trace (|value| range per layer call, oldest first, last {len(trace)}):"]
    for item in trace:
        mark = f"  <- {item['kind']}" if item["kind"] else ""
        mark += f"  <- {item['input_kind']} in inputs" if item["input_kind"] else ""
        lines.append(
            f"  step {item['step']:>5}  {item['layer']:<{width}}  {item['layer_class']:<14} "
            f"[{item['abs_min']:.4g}, {item['abs_max']:.4g}] {item['dtype']}{mark}"
        )
    return "\n".join(lines)


def _forward_message(item: dict, kind: str, step: int, hint: Optional[str]) -> str:
    """Names the layer and says whether its inputs were already bad, or float16 overflowed.

    `hint` is the cause and fix of a layer's known float16 hazard
    (`tfmp._src.float32.reductions`), said instead of the generic float16 advice.
    """
    if item["layer"] == LOSS_ENTRY:
        return (
            f"The loss is {kind} at train step {step} while every checked layer output before it "
            "was finite: the loss function produced it (e.g. log(0), a division by zero in a custom "
            "loss, or NaN/Inf labels)."
        )
    where = "in its output" if item["kind"] else "in its inputs (its output stays finite)"
    text = (
        f"Layer '{item['layer']}' ({item['layer_class']}) saw {kind} {where} at train step {step} "
        "(phase 'forward'); it is the first checked layer call to see a non-finite value."
    )
    span = item["input_range"]
    if span is None:
        return text
    text += f" Its inputs ranged over [{span[0]:.4g}, {span[1]:.4g}]."
    if item["input_kind"]:
        text += (
            " The inputs were already non-finite: the bad values came in with the data (check it with "
            "tfmp.check_dataset) or from an unchecked operation before this layer."
        )
    elif item["dtype"] == "float16" and "inf" in kind and hint:
        text += f" The likely cause: {hint}"
    elif item["dtype"] == "float16" and "inf" in kind:
        text += (
            f" float16 holds at most {FLOAT16_MAX:g}: if this layer computes large values "
            "(exponentials, squares, long sums), compute it in float32 (tfmp.force_float32) "
            "or keep its inputs smaller; if it divides or takes a logarithm, look for a zero there."
        )
    return text


def build_error(recorder: FailureRecorder, owners: dict, loss_scaling: bool,
                hints: Callable[[str], Optional[str]] = lambda path: None) -> Optional[NonFiniteError]:
    """Reads the recorded failure; None when nothing was recorded.

    Args:
        recorder: `FailureRecorder` of the hooks.
        owners: Dict from `id(variable)` to `(layer path, layer class)`.
        loss_scaling: Bool. Whether the optimizer scales the loss dynamically (only
            changes the wording for gradients).
        hints: Callable, layer path -> the cause and fix of that layer's known
            float16 hazard (a sentence), or None. Asked only for the failing layer.

    Returns:
        `tfmp.NonFiniteError` or None.
    """
    state = recorder.read_state()
    kind = NON_FINITE_KINDS.get(state[KIND])
    if kind is None:
        return None
    step, index = state[STEP], state[INDEX]
    scale = float(recorder.scale.numpy())
    details: dict[str, Any] = {"loss_scale": scale, "bad_gradients": state[BAD_GRADS]}
    if state[PHASE] == FORWARD and index < len(recorder.names):
        trace = _trace(recorder, index + 1, step)
        item = trace[-1]
        hint = None if item["layer"] == LOSS_ENTRY else hints(item["layer"])
        message = _forward_message(item, kind, step, hint)
        is_loss = item["layer"] == LOSS_ENTRY
        layer, phase = (None, "loss") if is_loss else (item["layer"], "forward")
        details.update(layer_class=item["layer_class"], input_range=item["input_range"], dtype=item["dtype"])
    else:
        trace = _trace(recorder, len(recorder.names), step)
        variable = recorder.variables[index] if index < len(recorder.variables) else None
        layer, layer_class = owners.get(id(variable), (None, None))
        var_path = getattr(variable, "path", getattr(variable, "name", "?"))
        phase = "backward"
        message = (
            f"The gradient of variable '{var_path}' (layer '{layer}', {layer_class}) is {kind} at "
            f"train step {step} (phase 'backward'); {state[BAD_GRADS]} of {len(recorder.variables)} "
            f"gradients are non-finite, loss scale {scale:g}. It is the non-finite gradient nearest the "
            "loss, so its layer's backward pass is the likely origin."
        )
        if loss_scaling:
            message += (
                " The loss scale is already at its floor, so this is not an overflow that lowering the "
                "scale can cure."
            )
        details.update(layer_class=layer_class, variable=var_path)
    details["trace"] = trace
    text = format_trace(trace)
    return NonFiniteError(
        message + ("\n" + text if text else ""),
        layer=layer,
        phase=phase,
        step=step,
        kind=kind,
        details=details,
    )
