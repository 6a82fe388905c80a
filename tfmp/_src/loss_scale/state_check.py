"""Loss-scale states no run reaches (a scale NaN, inf, 0 or negative; a negative counter), refused.

A file or checkpoint holding one would skip or poison every step and end in a stuck error that
blames the data. `saved_form` refuses it as it loads (`.keras`, `.weights.h5`) before assigning;
`loops` checks the optimizer's variables as `fit` starts (a `tf.train.Checkpoint` restore or an
``assign`` passes no tfmp code); a step meeting such a scale in a custom loop is skipped and the
scale set to `min_scale` (`LossScaleOptimizer`, status bit ``"scale"``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import numpy as np

from tfmp._src.errors import invalid_state

_COUNT = (lambda value: value >= 0, "an integer >= 0 (a count)", 0)
#: Scalar state variables checked: (valid, expected phrase, value a reset assigns; None: the initial scale).
RULES: Dict[str, Tuple[Callable[[float], bool], str, Optional[int]]] = {
    "dynamic_scale": (lambda value: math.isfinite(value) and value > 0,
                      "a finite loss scale > 0 (steps multiply the loss by it and divide the gradients by it)",
                      None),
    "step_counter": _COUNT,
    "overflow_count": _COUNT,
    "consecutive_overflows": _COUNT,
    "total_steps": _COUNT,
    "min_scale_overflows": _COUNT,
    "last_overflow_step": (lambda value: value >= -1, "an integer >= -1 (a step; -1: none skipped yet)", -1),
}


def _scalar(value: Any) -> Any:
    """A Python float or int of a saved or read scalar; None for anything else (another variable's layout)."""
    array = np.asarray(value)
    return array.item() if array.shape == () and array.dtype.kind in "fiu" else None


def _reset(optimizer: Any, name: str) -> str:
    value = RULES[name][2]
    return f"optimizer.{name}.assign({optimizer.initial_scale if value is None else value})"


def refuse_impossible(optimizer: Any, values: Iterable[Tuple[str, Any]], *, loading: bool) -> None:
    """Raises for the first ``(variable name, value)`` of `values` that no run of `optimizer` reaches.

    `loading`: the values come from a file being loaded (else: the optimizer's variables now).

    Raises:
        ValueError: (template) naming the variable, its value, what is valid and how to fix.
    """
    for name, value in values:
        value = _scalar(value)
        if name not in RULES or value is None or RULES[name][0](value):
            continue
        if loading:
            where = f"loaded into optimizer {optimizer.name!r}"
            fix = ("No run reaches this value: the file was edited or damaged. Fix: re-save it from a sound "
                   "run; or keep its weights and start the loss scale afresh: load them without the optimizer "
                   "(keras.models.load_model(path, compile=False), or model.load_weights(path) before "
                   "model.compile) and compile again, e.g. with tfmp.LossScaleOptimizer(inner, "
                   f"initial_scale={optimizer.initial_scale:g}).")
        else:
            where = f"in optimizer {optimizer.name!r}"
            fix = ("No run reaches this value: it was restored (a checkpoint) or assigned, and training "
                   "from it would skip or poison every step whatever the data or the learning rate. "
                   f"Fix: restore a sound checkpoint, or reset it: {_reset(optimizer, name)}.")
        raise invalid_state(name, value, RULES[name][1], fix=fix, where=where)


def check_variables(optimizer: Any) -> None:
    """`refuse_impossible` for the built `optimizer`'s variables as they are now."""
    refuse_impossible(optimizer, ((name, getattr(optimizer, name).numpy()) for name in RULES), loading=False)
