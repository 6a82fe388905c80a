"""The one line tfmp prints when it compiles a model: what it did, read from the attachment only.

E.g. ``tfmp: model 'digits' compiled under mixed_bfloat16; 1 layer forced to float32: softmax (model
output); optimizer tfmp.LossScaleOptimizer(Adam): ...``. Printed under ``enable(verbose=True)``, again
only when it would differ (a loop recompiling to change the learning rate says it once); never for
a model Keras compiles while loading it, nor at `fit`.
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
    """The line for `found` (attached at compile): policy, forced layers (up to `NAMED` named), the optimizer."""
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
