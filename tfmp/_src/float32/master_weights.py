"""16-bit trainable variables in a mixed-precision model: no float32 master weights, said once per model.

A variable created in 16 bits under a ``mixed_*`` policy is updated in 16 bits: bfloat16's
8 significant bits round small updates away, float16's 65504 overflows Adam's second
moment (`EFFECT`; IEEE 754 binary16 and bfloat16, as in ``ml_dtypes.finfo``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, List, Tuple

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.errors import user_stacklevel
from tfmp._src.layer_tree import own_weights, walk

#: What a 16-bit trainable variable does to training, per dtype.
EFFECT = {
    "bfloat16": ("bfloat16 keeps 8 significant bits: an update below half its spacing (2**-7 = 0.0078 "
                 "around 1.0) rounds away, and Adam's beta_2 = 0.999 is 1.0 in bfloat16, so it stops "
                 "learning"),
    "float16": ("float16 keeps 11 significant bits and holds at most 65504: updates below 2**-11 of "
                "the weight round away and Adam's second moment overflows for gradients above 256, "
                "so it stalls or runs away"),
}
_named: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # variables said, by id


def trainable_16bit(model: Any) -> List[Tuple[str, Any]]:
    """``(layer path, variable)`` of every trainable float16/bfloat16 variable of `model`'s layers."""
    return [(entry.path, weight) for entry in walk(model) for weight in own_weights(entry.layer)
            if weight.trainable and weight.dtype in LOW_PRECISION]


def warn_16bit_trainable(model: Any) -> None:
    """At attach: warns when a built mixed-precision model trains variables stored in 16 bits.

    Silent under a pure 16-bit policy and for an unbuilt model (`warn_16bit_applied` says it then).
    """
    if model.dtype_policy.variable_dtype in LOW_PRECISION or not model.built:
        return
    _warn(f"Model {model.name!r} ({model.dtype_policy.name})",
          [(f"{path}/{weight.name}", weight) for path, weight in trainable_16bit(model)])


def warn_16bit_applied(optimizer: Any, variables: List[Any]) -> None:
    """At a traced or eager `apply`: warns about 16-bit variables among float32 ones (models built after attach)."""
    low = [variable for variable in variables if variable.dtype in LOW_PRECISION]
    if low and len(low) < len(variables):
        _warn(f"Optimizer {optimizer.name!r}", [(variable.path, variable) for variable in low])


def _warn(owner: str, found: List[Tuple[str, Any]]) -> None:
    """Warns (UserWarning) once per variable: up to 5 named with their dtype, what they do (`EFFECT`), the fix."""
    found = [(name, weight) for name, weight in found if _named.get(id(weight)) is not weight]
    if not found:
        return
    for _, weight in found:
        _named[id(weight)] = weight
    named = ", ".join(f"'{name}' ({weight.dtype})" for name, weight in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    effects = " ".join(f"{EFFECT[dtype]}." for dtype in sorted({weight.dtype for _, weight in found}))
    warnings.warn(
        f"{owner} trains {len(found)} variable(s) stored in 16 bits, without float32 master weights: "
        f"{named}{more}. {effects} Create them in float32: leave `dtype` out of add_weight (a layer "
        "under a 'mixed_*' policy then keeps them in float32) or pass dtype='float32'; Keras casts "
        "them to the compute dtype in call. A layer given a pure 16-bit policy needs a 'mixed_*' one.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
