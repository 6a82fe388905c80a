"""Turns the failure recorded by `FailureRecorder` into a `tfmp.NonFiniteError`.

Runs on the host between train steps; only reads variables.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from tfmp._src.constants import FLOAT16_MAX, NON_FINITE_KINDS
from tfmp._src.errors import NonFiniteError, opening
from tfmp._src.numerics.record import (ABOVE, ABS_MAX, ABS_MIN, BAD_GRADS, FORWARD, HAS_INPUT, IN_GRAD, IN_MAX, IN_MIN,
                                       INDEX, KIND, LAYER_BACKWARD, LOSS_ENTRY, OUT_GRAD, PHASE, STEP, VALID,
                                       WEIGHT_GRAD, FailureRecorder)
from tfmp._src.numerics.terms import term_message


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
        path, layer_class, dtype, term = names[position % count]
        trace.append({
            "step": step + position // count, "layer": path, "term": term, "layer_class": layer_class,
            "dtype": dtype, "abs_min": float(row[ABS_MIN]), "abs_max": float(row[ABS_MAX]),
            "kind": _kind(row[ABS_MIN], row[ABS_MAX]),
            "input_kind": _kind(row[IN_MIN], row[IN_MAX]) if row[HAS_INPUT] else None,
            "input_range": (float(row[IN_MIN]), float(row[IN_MAX])) if row[HAS_INPUT] else None,
        })
    return trace


def _label(item: dict) -> str:
    """A trace row's name: the layer path, and for a loss term which one."""
    term = item.get("term")
    if term is None:
        return item["layer"]
    return f"{item['layer'] or '(model)'} [{term.kind}{' ' + term.variable if term.variable else ''}]"


def format_trace(trace: list[dict]) -> str:
    """One line per trace entry: step, layer path, class, |output| range, kind."""
    if not trace:
        return ""
    labels = [_label(item) for item in trace]
    width = max(len(label) for label in labels)
    lines = [f"Trace (|value| range per layer call and loss term, oldest first, last {len(trace)}):"]
    for item, label in zip(trace, labels):
        mark = f"  <- {item['kind']}" if item["kind"] else ""
        mark += f"  <- {item['input_kind']} in inputs" if item["input_kind"] else ""
        lines.append(
            f"  step {item['step']:>5}  {label:<{width}}  {item['layer_class']:<14} "
            f"[{item['abs_min']:.4g}, {item['abs_max']:.4g}] {item['dtype']}{mark}"
        )
    return "\n".join(lines)


def _forward_message(item: dict, kind: str, step: int, hint: Optional[str]) -> tuple:
    """(what, cause, fix) naming the layer and whether its inputs were already bad, or float16 overflowed.

    `hint`, the cause and fix of the layer's known float16 hazard, replaces the generic advice.
    """
    if item["layer"] == LOSS_ENTRY:
        return (
            f"The loss is {kind} at train step {step} while every checked layer output before it was finite.",
            "Hence the loss function produced it: e.g. log(0), a division by zero in a custom loss, or NaN/Inf labels.",
            "Fix: guard the loss (an epsilon, keras.ops.clip); check the labels with tfmp.check_dataset.",
        )
    where = "in its output" if item["kind"] else "in its inputs only"
    what = (f"Layer '{item['layer']}' ({item['layer_class']}) is the first checked layer to see {kind} ({where}), "
            f"at train step {step}.")
    span = item["input_range"]
    ranged = "" if span is None else f"Its inputs ranged over [{span[0]:.4g}, {span[1]:.4g}]"
    if span is not None and item["input_kind"]:
        return (what, f"{ranged}: inputs were already non-finite, from the data or an unchecked op before it.",
                "Fix: check the data with tfmp.check_dataset, or the operation before this layer.")
    if span is not None and item["dtype"] == "float16" and hint:  # a known hazard: an overflow, or NaN after one
        cause, _, fix = hint.partition(". ")  # `advice`: the cause, then the fix
        return (what, f"The likely cause: {cause.rstrip('.')}.",
                f"Fix: {fix[0].lower()}{fix[1:]}" if fix else "Fix: compute the layer in float32 (tfmp.force_float32).")
    if span is not None and item["dtype"] == "float16" and "inf" in kind:
        return (what, f"{ranged}; float16 holds at most {FLOAT16_MAX:g}.",
                "Fix: compute it in float32 (tfmp.force_float32) or keep its inputs smaller; look for a 0 it divides by.")
    cause = f"{ranged}." if ranged else "Its inputs were finite."
    return what, cause, "Fix: look in its call for log, sqrt or a division at 0, or an overflow; lower the learning rate."


def _gradient(value: float) -> str:
    """A max |gradient| for a message: its kind when non-finite, else the number."""
    return _kind(value) or f"finite (max |g| {value:.4g})"


def _backward_message(recorder: FailureRecorder, phase_code: int, index: int, kind: str, step: int) -> tuple:
    """(message, layer path, details) of a failure named at a layer call's backward pass."""
    path, layer_class, dtype, has_weights = recorder.boundary_names[index]
    grads = [float(v) for v in recorder.boundary.numpy()]
    details = {"layer_class": layer_class, "dtype": dtype, "output_gradient": grads[OUT_GRAD],
               "input_gradient": grads[IN_GRAD], "weight_gradient": grads[WEIGHT_GRAD]}
    if phase_code == ABOVE:
        return (
            f"The gradient reaching the output of layer '{path}' ({layer_class}) is already {kind} at train "
            f"step {step}.",
            "No checked layer after it made it: the loss function's backward pass produced it, or an unchecked op.",
            "Fix: look in the loss for sqrt, log or a norm of the prediction at 0; add an epsilon.",
        ), path, details
    passed = [f"to its inputs {_gradient(grads[IN_GRAD])}"]
    if has_weights:
        passed.append(f"to its weights {_gradient(grads[WEIGHT_GRAD])}")
    message = (
        f"The backward pass of layer '{path}' ({layer_class}) turned a finite gradient into {kind} at train "
        f"step {step}.",
        f"The gradient reaching its output was {_gradient(grads[OUT_GRAD])}, the gradient it passed "
        f"{', '.join(passed)}.",
        "Fix: in its call, add an epsilon where a derivative is infinite (tf.sqrt(x + 1e-12)) or divide_no_nan.",
    )
    return message, path, details


def build_error(recorder: FailureRecorder, owners: dict, loss_scaling: bool, hints: Callable[[str], Optional[str]],
                model_name: str) -> Optional[NonFiniteError]:
    """The recorded failure as a `tfmp.NonFiniteError`, or None when nothing was recorded.

    `owners` maps `id(variable)` to `(layer path, layer class)`; `loss_scaling` only changes
    the wording for gradients; `hints(path)` gives the failing layer's known float16 hazard
    (a sentence) or None; `model_name` names a loss term the model added itself.
    """
    state = [int(v) for v in recorder.state.numpy()]
    kind = NON_FINITE_KINDS.get(state[KIND])
    if kind is None:
        return None
    step, index = state[STEP], state[INDEX]
    scale = float(recorder.scale.numpy())
    details: dict[str, Any] = {"loss_scale": scale, "bad_gradients": state[BAD_GRADS]}
    if state[PHASE] == FORWARD and index < len(recorder.names):
        trace = _trace(recorder, index + 1, step)
        item = trace[-1]
        term = item["term"]
        if term is not None:
            message = term_message(item, kind, step, model_name)
            layer, phase = item["layer"], "loss"
            details.update(loss_term=term.kind, variable=term.variable, regularizer=term.regularizer)
        else:
            is_loss = item["layer"] == LOSS_ENTRY
            message = _forward_message(item, kind, step, None if is_loss else hints(item["layer"]))
            layer, phase = (None, "loss") if is_loss else (item["layer"], "forward")
        details.update(layer_class=item["layer_class"], input_range=item["input_range"], dtype=item["dtype"])
    elif state[PHASE] in (LAYER_BACKWARD, ABOVE) and index < len(recorder.boundary_names):
        trace = _trace(recorder, len(recorder.names), step)
        message, layer, found = _backward_message(recorder, state[PHASE], index, kind, step)
        phase = "backward"
        details.update(found, variable=None)
    else:
        trace = _trace(recorder, len(recorder.names), step)
        variable = recorder.variables[index] if index < len(recorder.variables) else None
        layer, layer_class = owners.get(id(variable), (None, None))
        var_path = getattr(variable, "path", getattr(variable, "name", "?"))
        phase = "backward"
        message = (
            f"The gradient of variable '{var_path}' (layer '{layer}', {layer_class}) is {kind} at train step {step}.",
            "It is the non-finite gradient nearest the loss, so its layer's backward pass is the likely origin.",
            "Fix: look in that layer's call for sqrt, log or a division at 0, or a custom gradient.",
        )
        details.update(layer_class=layer_class, variable=var_path)
    below = []  # details below the guide line
    if phase == "backward":
        below.append(f"{state[BAD_GRADS]} of {len(recorder.variables)} weight gradients are non-finite, "
                     f"loss scale {scale:g}" + (" (its floor: not an overflow a lower scale can cure)."
                                                if loss_scaling else "."))
    details["trace"] = trace
    below.append(format_trace(trace))
    text = opening(*message, "nan-or-inf-loss", details="\n".join(line for line in below if line))
    return NonFiniteError(text, layer=layer, phase=phase, step=step, kind=kind, details=details)
