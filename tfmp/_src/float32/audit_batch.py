"""`tfmp.audit(model, batch=...)`: one forward and backward pass, leaving the model as it was.

Reports each gradient's and output's dtype, and turns an error that says two dtypes do
not match into a ``dtype_mismatch`` warning; every other error propagates.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, List, Optional, Tuple

import keras
import tensorflow as tf

from tfmp._src.errors import invalid_argument
from tfmp._src.float32.audit_report import AuditWarning, GradientRow
from tfmp._src.keras_hooks import error_texts
from tfmp._src.keras_hooks.layer_calls import build_state_restored_on_error

_FIX = (
    "cast constants and other tensors to `self.compute_dtype` inside `call()` "
    "(e.g. `keras.ops.cast(c, self.compute_dtype)`)"
)


def _dtype_error_layers(error: Exception, entries) -> List[str]:
    """Paths of the layers named in a Keras "when calling X.call()" error."""
    classes = set(re.findall(r"calling (\w+)\.call\(\)", str(error)))
    return [path for path, layer, _ in entries if type(layer).__name__ in classes]


def _message(error: BaseException) -> str:
    """The error's own text (an `OpError`'s message without TensorFlow's prefix)."""
    if isinstance(error, tf.errors.OpError):
        return error.message or ""
    return str(error.args[0]) if error.args else ""


def _as_raised(error: BaseException) -> BaseException:
    """The error as the failing op raised it: `__context__` while each step is a Keras re-raise (same class, text)."""
    for _ in range(8):  # one step per Keras wrapper; a bound against cycles
        inner = error.__context__
        text = _message(inner) if inner is not None else ""
        if inner is None or type(inner) is not type(error) or not text or text not in _message(error):
            break
        error = inner
    return error


def _dtype_mismatch_line(error: BaseException) -> Optional[str]:
    """The first line of `error` as the op raised it (`_as_raised`) when it says two dtypes do not match."""
    raised = _as_raised(error)
    lines = _message(raised).strip().splitlines()
    first = lines[0].strip() if lines else ""
    if error_texts.is_dtype_mismatch(raised, first):  # keras_hooks.error_texts.DTYPE_MISMATCH
        first = first.split(": <tf.Tensor")[0]  # a conversion error prints the values
        return re.sub(r"\s+name:\s*\S*$", "", first)  # eager ops end in "[Op:AddV2] name: "
    return None


@contextlib.contextmanager
def _variables_restored(model: keras.Model) -> Iterator[None]:
    """Puts every variable of `model` back when the block exits (those it creates: their initial value)."""
    saved = {id(v): (v, v.numpy()) for v in list(model.variables) + list(model.metrics_variables)}
    created: List[Tuple[Any, Any]] = []

    def remember(next_creator: Any, **kwargs: Any) -> Any:
        variable = next_creator(**kwargs)
        created.append((variable, variable.numpy()))
        return variable

    try:
        with tf.variable_creator_scope(remember):
            yield
    finally:
        for variable, value in list(saved.values()) + created:
            variable.assign(value)


def _input_specs(model: keras.Model) -> Optional[list]:
    """The shapes of a built graph model's inputs, or None (subclassed, unbuilt)."""
    try:
        return [tuple(spec.shape) for spec in keras.tree.flatten(model.inputs)]
    except (AttributeError, ValueError):  # Keras: a model without a graph has no `inputs`
        return None


def check_batch(model: keras.Model, batch: Any) -> None:
    """Checks `tfmp.audit`'s `batch` before the pass: arrays, and the inputs' shapes where known.

    Raises:
        ValueError: `batch` (or its ``x``) is not made of arrays or tensors with a
            non-empty batch axis, or does not match a graph model's input shapes.
    """
    x = batch[0] if isinstance(batch, tuple) and batch else batch
    leaves = keras.tree.flatten(x)
    expected = "an input batch: an array or tensor (or a tuple (x, y, ...), or a structure of them as the model takes)"
    if not leaves or not all(hasattr(leaf, "shape") and hasattr(leaf, "dtype") for leaf in leaves):
        raise invalid_argument("batch", batch, expected, fix="Pass e.g. batch=x_train[:8].")
    shapes = [tuple(leaf.shape) for leaf in leaves]
    if any(not shape or not shape[0] for shape in shapes):
        raise invalid_argument("batch", batch, expected + " with at least one example",
                               fix="Pass e.g. batch=x_train[:8].")
    specs = _input_specs(model)
    if specs is None or len(specs) != len(shapes):
        return
    for shape, spec in zip(shapes, specs):
        if len(shape) != len(spec) or any(want is not None and got != want
                                           for got, want in zip(shape[1:], spec[1:])):
            raise invalid_argument(
                "batch", batch, f"inputs of the shapes model {model.name!r} takes: {specs}",
                fix=f"Received shapes {shapes}; pass a batch of the model's inputs.",
            )


def gradient_check(model, batch, entries):
    """One training-mode forward/backward pass, variables and build state restored: (gradient rows, output dtypes,
    warnings); errors other than a dtype mismatch propagate."""
    x = batch[0] if isinstance(batch, tuple) else batch
    with _variables_restored(model), build_state_restored_on_error(model):
        try:
            with tf.GradientTape() as tape:
                outputs = keras.tree.flatten(model(x, training=True))
                loss = sum(keras.ops.mean(keras.ops.square(keras.ops.cast(o, "float32")))
                           for o in outputs)
        except (tf.errors.InvalidArgumentError, TypeError, ValueError) as error:
            first = _dtype_mismatch_line(error)
            if first is None:
                raise
            paths = _dtype_error_layers(error, entries) or ["<unknown layer>"]
            message = (f"forward pass failed on mixed dtypes in {', '.join(paths)}: "
                       f"{first} Fix: {_FIX}.")
            return (), (), [AuditWarning("dtype_mismatch", paths[0], message)]
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
    gradients = tuple(
        GradientRow(v.path, v.dtype, g if g is None else keras.backend.standardize_dtype(g.dtype))
        for v, g in zip(variables, grads)
    )
    out_dtypes = tuple(keras.backend.standardize_dtype(o.dtype) for o in outputs)
    return gradients, out_dtypes, []
