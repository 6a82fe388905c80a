"""The terms of a model's total loss, each checked and named, for `tfmp.check_numerics`.

When a term of ``model.losses`` (``add_loss``, an activity or weight regularizer) is inf
or NaN, so is the loss, with every layer output finite: the report names the term, its
layer and the fix. Each term is reduced to a trace row right after the train step reads
it (`keras_hooks.loss_terms.watch`), between the layers' rows and the loss's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import tensorflow as tf

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import loss_terms
from tfmp._src.numerics.record import entry_row

#: `TermSource.kind` values.
ADD_LOSS, ACTIVITY, ADD_LOSS_OR_ACTIVITY, WEIGHT, UNKNOWN = (
    "add_loss", "activity_regularizer", "add_loss_or_activity_regularizer", "weight_regularizer", "unknown")


@dataclasses.dataclass(frozen=True)
class TermSource:
    """Where term `position` of ``model.losses`` comes from: its `kind` (``ADD_LOSS_OR_ACTIVITY``
    for an unchecked layer holding both, ``UNKNOWN`` when ``losses`` is overridden) and, for a
    regularizer, the variable's path and the regularizer (``"L2(l2=1e+30)"``)."""

    kind: str
    position: int
    variable: Optional[str] = None
    regularizer: Optional[str] = None


def describe_regularizer(regularizer: Any) -> Optional[str]:
    """``"L2(l2=0.01)"``: a regularizer's class and config (tfmp's float32 wrapper seen through)."""
    if regularizer is None:
        return None
    regularizer = getattr(regularizer, "regularizer", regularizer)  # `Float32Regularizer`
    try:
        config = regularizer.get_config()
    except (AttributeError, NotImplementedError, TypeError):
        config = {}
    shown = ", ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value!r}"
                      for key, value in config.items())
    return f"{getattr(regularizer, '__name__', type(regularizer).__name__)}({shown})"


def term_entries(model: Any, terms: list, added_in_call: set, checked: set,
                 where: Callable[[Any], tuple[Optional[str], str]]) -> list[tuple]:
    """Trace entries `(path, class, dtype, row, TermSource)` of the float terms of `model.losses`.

    `terms` is the list read; `added_in_call` the `id`s of terms a checked layer's own
    ``call`` added; `checked` the `id`s of checked layers; `where(layer or variable)` the
    (path, class name) of the layer holding it (path None for the model).
    """
    sources = loss_terms.term_sources(model)
    if sources is None or len(sources) != len(terms):
        sources = [None] * len(terms)
    entries = []
    for position, (term, source) in enumerate(zip(terms, sources)):
        row = entry_row(term)
        if row is None:
            continue
        dtype = tf.as_dtype(term.dtype).name
        if source is None:
            path, layer_class = where(model)
            entries.append((path, layer_class, dtype, row, TermSource(UNKNOWN, position)))
            continue
        origin, owner, detail = source
        if origin == "weight":
            path, layer_class = where(detail)
            found = TermSource(WEIGHT, position, getattr(detail, "path", detail.name),
                               describe_regularizer(detail.regularizer))
        else:
            path, layer_class = where(owner)
            activity = getattr(owner, "activity_regularizer", None)
            if activity is None or id(detail) in added_in_call:
                kind = ADD_LOSS
            else:
                kind = ACTIVITY if id(owner) in checked else ADD_LOSS_OR_ACTIVITY
            found = TermSource(kind, position, None, describe_regularizer(activity) if kind != ADD_LOSS else None)
        entries.append((path, layer_class, dtype, row, found))
    return entries


def term_message(item: dict, kind: str, step: int, model_name: str) -> tuple:
    """(what, cause, fix) naming a non-finite loss term (a trace item whose ``"term"`` is a `TermSource`)."""
    term: TermSource = item["term"]
    layer = f"layer '{item['layer']}' ({item['layer_class']})" if item["layer"] else f"model '{model_name}'"
    low = item["dtype"] in LOW_PRECISION
    at = f"at train step {step}."
    not_loss = "Every checked layer output before it was finite: this term, not the loss function, is non-finite."
    if term.kind == WEIGHT:
        fix = (f"Fix: the term is computed in {item['dtype']}, the variable's dtype: use a mixed policy, or lower "
               "the factor." if low else
               "Fix: lower the regularizer's factor: it multiplies a sum over the weights (float32 reaches 3.4e38).")
        return (f"The loss term of regularizer {term.regularizer} on variable '{term.variable}' of {layer} "
                f"is {kind} {at}", not_loss, fix)
    if term.kind == ACTIVITY:
        return (f"The loss term of {layer}'s activity regularizer {term.regularizer} is {kind} {at}", not_loss,
                f"Fix: lower the regularizer's factor or keep the layer's outputs smaller (computed in {item['dtype']}).")
    overflow = f" of {item['dtype']}" if low else ""
    add_loss = ("compute it in float32 (keras.ops.cast its inputs to 'float32' first) or guard it (an epsilon, "
                "keras.ops.clip)")
    if term.kind == ADD_LOSS:
        return (f"The loss term {layer} adds with add_loss is {kind} {at}",
                f"The computation in its call() that feeds add_loss produced it (log of 0, 0/0, an overflow{overflow}).",
                f"Fix: {add_loss}.")
    if term.kind == ADD_LOSS_OR_ACTIVITY:
        return (f"A loss term of {layer} is {kind} {at}",
                f"Its activity regularizer {term.regularizer} or an add_loss term: the layer is unchecked, so tfmp "
                "cannot tell which.", "Fix: lower the regularizer's factor; for an add_loss term, compute it in "
                "float32 or add an epsilon.")
    return (f"Term {term.position} of model.losses is {kind} {at}",
            "The model's losses are overridden, so tfmp cannot name the layer that added it.",
            "Fix: guard each term the model's `losses` returns (an epsilon, a float32 cast).")
