"""The one line tfmp prints when it compiles a model: what it did, read from the attachment.

Under ``tfmp.enable(verbose=True)`` (the default) each ``model.compile`` tfmp
handles prints, once, a line built from the model's `tfmp.Attachment` only, so
it says what tfmp recorded and nothing else::

    tfmp: model 'digits_classifier' compiled under mixed_bfloat16; 1 layer forced
    to float32: softmax (model output); optimizer tfmp.LossScaleOptimizer(Adam):
    no loss scaling (fixed scale 1.0), guard='auto', fused updates on

(one line; wrapped here). `fit` prints nothing. Compiling the same model again
prints again only when the line would differ (another policy, other layers
forced, another optimizer): a loop that recompiles to change the learning rate
says it once. Models Keras compiles while loading them print nothing (they come
back as saved). ``verbose=False`` prints nothing; the same facts stay readable
with `tfmp.attachment(model)` and `tfmp.audit(model)`.
"""

from __future__ import annotations

import collections
import sys
import weakref
from typing import Any

from tfmp._src.attachment.record import Attachment

#: Layers named one by one; more are summarised as counts by reason.
NAMED = 4
_KEPT = ": kept (float32 compute)"
#: The last line printed for a model (kept off the model: `tfmp.detach` leaves it as Keras made it).
_said: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _reason(reason: str) -> str:
    return "model output" if reason == "output" else reason


def _forced(forced: dict) -> str:
    if not forced:
        return "no layer forced to float32"
    count = len(forced)
    head = f"{count} layer{'s' if count > 1 else ''} forced to float32"
    if count <= NAMED:
        return f"{head}: " + ", ".join(f"{path} ({_reason(why)})" for path, why in forced.items())
    by_reason = collections.Counter(_reason(why) for why in forced.values())
    counts = ", ".join(f"{n} {why}" for why, n in by_reason.most_common())
    first = ", ".join(list(forced)[:NAMED - 1])
    return f"{head}: {counts} (first: {first}, ...)"


def _optimizer(text: str) -> str:
    if not text:
        return "no optimizer"
    if text.endswith(_KEPT):
        return f"optimizer {text[:-len(_KEPT)]} left alone (float32 compute)"
    # "tfmp.LossScaleOptimizer(Adam): dynamic loss scale | no loss scaling, guard=..., fused updates ..."
    return "optimizer " + text.replace("no loss scaling", "no loss scaling (fixed scale 1.0)", 1)


def describe(found: Attachment) -> str:
    """The line for `found`: policy, layers forced to float32 and why, the optimizer.

    Args:
        found: `tfmp.Attachment` of a model attached at compile.

    Returns:
        String, one line: ``"tfmp: model '<name>' compiled under <policy>;
        <forced>; optimizer <what tfmp did>"``, plus ``"; check_numerics on"``
        under ``debug``. Up to `NAMED` forced layers are named with their
        reason; more are counted by reason, the first few named. (Optimizers
        a custom ``compile`` stores after ``super().compile()`` are wrapped
        after the line is printed: `tfmp.attachment(model).custom_optimizers`
        lists them.)
    """
    parts = [f"tfmp: model {found.model!r} compiled under {found.policy}", _forced(found.forced_float32),
             _optimizer(found.optimizer)]
    if found.check_numerics:
        parts.append("check_numerics on")
    return "; ".join(parts)


def say(model: object, found: Attachment) -> None:
    """Prints `describe(found)` to stdout unless it is the last line printed for `model`."""
    line = describe(found)
    if _said.get(model) == line:
        return
    _said[model] = line
    print(line, file=sys.stdout, flush=True)
