"""The loss-terms surface: ``Layer.losses``, read by ``compute_loss``; its one subscriber casts 16-bit terms to float32.

Keras's ``compute_loss`` sums the compiled loss (float32: a ``keras.losses.Loss``
computes in ``floatx``) with every term of ``model.losses`` in one
``ops.sum``. A term a layer adds with ``self.add_loss(...)`` from its 16-bit
tensors (the KL term of the Keras VAE example), an activity regularizer's term,
or a weight regularizer's term over 16-bit variables (pure 16-bit policies) is a
float16/bfloat16 tensor, and the sum fails under plain Keras mixed precision
("Cannot convert a list containing a tensor of dtype bfloat16 to float32").

For a model tfmp attached (`tfmp._src.attachment`: compiled or loaded while
enabled, or first read while enabled), ``Layer.losses`` (the property every
loss term is read through: Keras's ``compute_loss``, a user's ``compute_loss``
or custom loop summing ``model.losses``, ``stateless_call``) hands back each
16-bit floating term cast to float32, so the total loss is summed in float32.
The hook is on the class, installed while a thread is enabled or an attached
model is alive; it decides by the object's attachment, never by the thread that
reads the property, so the model keeps this after `tfmp.disable()` and in
`tf.distribute` replica threads. Any other object's terms come back as Keras
hands them back. Terms already in
float32 (weight regularizers over float32 master weights under a mixed policy)
come back as they are, the very same tensors. This is the one visible change:
``model.losses`` holds float32 tensors where plain Keras would hold 16-bit ones,
which plain Keras could not add to the compiled loss anyway. A term read eagerly
after the step that made it was traced (``model.losses`` after ``fit``, in a
callback) is a symbolic tensor of that finished graph: it comes back as it is,
as plain Keras hands it back, since no op can read it any more.
"""

from __future__ import annotations

from typing import Any, Callable, List

import keras
import tensorflow as tf

from tfmp._src.attachment import record
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import patches
from tfmp._src.keras_hooks.patches import defining_class

Hook = patches.Hook  # what subscribing returns: `.remove()` unsubscribes
SURFACE = patches.Surface("loss terms", methods=("losses",), subscribers=("enable.losses",))

#: (what tfmp relies on Keras doing, the test that checks it).
CALL_ORDER = (
    ("compute_loss sums `model.losses`, read through the Layer.losses property",
     "tests/test_attachment.py::test_a_model_compiled_while_enabled_sums_its_16_bit_loss_terms_after_disable"),
)


def to_float32(term: Any) -> Any:
    """`term` cast to float32 when it is a float16/bfloat16 tensor, else `term` itself."""
    dtype = getattr(term, "dtype", None)
    if dtype is not None and keras.backend.standardize_dtype(dtype) in LOW_PRECISION:
        return keras.ops.cast(term, "float32")
    return term


def _wrap_losses(original: Any) -> property:
    """Builds the hooked ``losses`` property from the one below it in the stack."""
    getter: Callable[[Any], List[Any]] = original.fget if isinstance(original, property) else original

    def losses(self: Any) -> List[Any]:
        if not record.attached_or_first_use(self):
            return getter(self)
        stale = tf.executing_eagerly()  # read eagerly, a symbolic term is a finished trace's
        return [term if stale and tf.is_symbolic_tensor(term) else to_float32(term) for term in getter(self)]

    losses.__doc__ = getter.__doc__
    return property(losses)


def install_losses_hook() -> patches.Hook:
    """Makes ``Layer.losses`` hand back 16-bit loss terms cast to float32.

    Installed on the class that defines ``losses`` (``keras.layers.Layer``), so
    every layer and model sees it (attached ones cast their terms); owner
    ``"enable.losses"``.

    Returns:
        `patches.Hook`; remove it to restore Keras's property.
    """
    owner = defining_class(keras.layers.Layer, "losses")
    return SURFACE.subscribe(owner, "losses", _wrap_losses, owner="enable.losses")
