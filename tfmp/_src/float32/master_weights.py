"""16-bit trainable variables in a mixed-precision model: float32 master copies, or said once per model.

A variable created in 16 bits under a ``mixed_*`` policy and updated in 16 bits stops
learning: bfloat16's 8 significant bits round small updates away, float16's 65504
overflows Adam's second moment (`EFFECT`; IEEE 754 binary16 and bfloat16, as in
``ml_dtypes.finfo``). `tfmp.LossScaleOptimizer` keeps a float32 copy of each
(`MasterCopies`); a model whose optimizer is another is told once.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, List, Tuple

import keras
import tensorflow as tf

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.errors import warn
from tfmp._src.keras_hooks.optimizer_steps import update_each
from tfmp._src.layer_tree import own_weights, walk

#: What a 16-bit trainable variable does to training, per dtype.
EFFECT = {
    "bfloat16": "updates below 2**-8 of a bfloat16 weight round away",
    "float16": "updates below 2**-11 of a float16 weight round away",
}
#: The name scope of the ops `MasterCopies` adds to a step (none in a step without copies).
SCOPE = "master_copies"
_named: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # variables said, by id


def trainable_16bit(model: Any) -> List[Tuple[str, Any]]:
    """``(layer path, variable)`` of every trainable float16/bfloat16 variable of `model`'s layers."""
    return [(entry.path, weight) for entry in walk(model) for weight in own_weights(entry.layer)
            if weight.trainable and weight.dtype in LOW_PRECISION]


def warn_16bit_trainable(model: Any, master_copies: bool) -> None:
    """At attach: warns when a built mixed-precision model trains variables stored in 16 bits
    without float32 master copies (`master_copies`: its optimizer is a `tfmp.LossScaleOptimizer`).

    Silent under a pure 16-bit policy and for an unbuilt model.
    """
    if master_copies or model.dtype_policy.variable_dtype in LOW_PRECISION or not model.built:
        return
    optimizer = getattr(model, "optimizer", None)
    _warn(f"Model {model.name!r} ({model.dtype_policy.name})",
          f"Its {'optimizer' if optimizer is None else type(optimizer).__name__} (not a tfmp.LossScaleOptimizer) "
          "keeps no float32 copies: ",
          [(f"{path}/{weight.name}", weight) for path, weight in trainable_16bit(model)])


def mixed_16bit(variables: List[Any]) -> List[Any]:
    """The float16/bfloat16 ones of `variables` when some others are not 16-bit (a mixed model's); else []."""
    low = [variable for variable in variables if variable.dtype in LOW_PRECISION]
    return low if len(low) < len(variables) else []


def float32_gradients(grads: List[Any], variables: List[Any]) -> List[Any]:
    """`grads` with those of `mixed_16bit(variables)` cast to float32: the gradients of their float32 copies,
    cast before the step's branches (one graph) and all-reduced with the others (one dtype)."""
    low = {id(variable) for variable in mixed_16bit(variables)}
    return [tf.cast(g, tf.float32) if g is not None and id(v) in low else g for g, v in zip(grads, variables)]


class MasterCopies:
    """Float32 copies of a mixed model's 16-bit trainable variables, made by a `tfmp.LossScaleOptimizer`.

    The inner optimizer builds its slots on the copies and updates them (`substitute`), so
    its moments and Adam's bias correction are float32; after each applied step the 16-bit
    variable is assigned its copy rounded (`round_to_variables`). The copies are not
    optimizer variables (the saved file keeps Keras's layout): a 16-bit variable changed
    elsewhere (a loaded file, `set_weights`, an assign) no longer equals its rounded copy, and
    `refresh` takes its value back into the copy before the step.

    Args:
        variables: List of the optimizer's trainable variables; copies are made of those
            `mixed_16bit` returns (none for a model without 16-bit trainable variables).
    """

    def __init__(self, variables: List[Any]) -> None:
        self.pairs = [(variable, _float32_copy(variable)) for variable in mixed_16bit(variables)]
        self._copy_of = {id(variable): copy for variable, copy in self.pairs}

    def __bool__(self) -> bool:
        return bool(self.pairs)

    @property
    def copies(self) -> List[Any]:
        """The float32 `keras.Variable` copies, in the order of the 16-bit variables."""
        return [copy for _, copy in self.pairs]

    def substitute(self, variables: List[Any]) -> List[Any]:
        """`variables` with each 16-bit variable replaced by its copy (its gradient: `float32_gradients`)."""
        return [self._copy_of.get(id(variable), variable) for variable in variables]

    def refresh(self) -> None:
        """Each copy takes its variable's value where the variable no longer equals the copy rounded."""
        with tf.name_scope(SCOPE):
            update_each(_take_changed, [(copy, variable) for variable, copy in self.pairs])

    def round_to_variables(self) -> None:
        """Each 16-bit variable is assigned its copy, rounded to its dtype."""
        with tf.name_scope(SCOPE):
            update_each(_assign_rounded, self.pairs)


def _float32_copy(variable: Any) -> keras.Variable:
    """A float32 copy of `variable`, at its path (the inner optimizer names its slots from it)."""
    parent, _, name = getattr(variable, "path", variable.name).rpartition("/")
    grandparent, _, parent = parent.rpartition("/")
    with keras.name_scope(parent, override_parent=grandparent) if parent else contextlib.nullcontext():
        return keras.Variable(lambda shape, dtype: tf.cast(variable, dtype), shape=variable.shape,
                              dtype="float32", trainable=False, name=name.partition(":")[0])


def _take_changed(copy: tf.Variable, variable: tf.Variable) -> Any:
    unchanged = tf.equal(tf.cast(copy, variable.dtype), variable)
    return copy.assign(tf.where(unchanged, copy, tf.cast(variable, copy.dtype)))


def _assign_rounded(variable: tf.Variable, copy: tf.Variable) -> Any:
    return variable.assign(tf.cast(copy, variable.dtype))


def _warn(owner: str, why: str, found: List[Tuple[str, Any]]) -> None:
    """Warns (UserWarning) once per variable: up to 5 named with their dtype, what they do (`EFFECT`), the fix."""
    found = [(name, weight) for name, weight in found if _named.get(id(weight)) is not weight]
    if not found:
        return
    for _, weight in found:
        _named[id(weight)] = weight
    named = ", ".join(f"'{name}' ({weight.dtype})" for name, weight in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    effects = "; ".join(EFFECT[dtype] for dtype in sorted({weight.dtype for _, weight in found}))
    warn(f"{owner} trains {len(found)} variable(s) stored in 16 bits: {named}{more}.",
         f"{why}{effects}.",
         "Fix: compile under tfmp.enable(), or in add_weight leave `dtype` out or pass dtype='float32'.",
         UserWarning, section="variables-stored-in-16-bits")
