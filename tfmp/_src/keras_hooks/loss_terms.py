"""The loss-terms surface: ``Layer.losses``, read by ``compute_loss``; 16-bit terms cast to float32, each term's source.

Keras's ``compute_loss`` sums the float32 compiled loss with every term of
``model.losses`` in one ``ops.sum``, which fails under plain Keras mixed precision on a
16-bit term (an ``add_loss`` term such as the Keras VAE's KL term, an activity
regularizer's, a weight regularizer's over 16-bit variables). For a model tfmp attached,
``Layer.losses`` (hooked on the class, decided by the object's attachment, never by the
reading thread) hands each 16-bit floating term back cast to float32; float32 terms, and
terms of a finished trace read eagerly, come back as they are, as do any other object's.
Subscribers, innermost first: ``enable.losses`` (above) and ``numerics``
(`tfmp.check_numerics`, subscribed with `watch` while its model's train step is traced).

| private name used | where in Keras | what tfmp does with it |
|---|---|---|
| ``Layer._losses_override`` | ``keras/src/layers/layer.py`` | `term_sources`: a model whose ``losses`` are overridden lists them as they are |
| ``Layer._get_own_losses`` | ``keras/src/layers/layer.py`` | `term_sources`, `own_terms`: the terms one layer added (``add_loss``, its activity regularizer) |
| ``Layer._flatten_layers`` | ``keras/src/layers/layer.py`` | `term_sources`: the sublayers ``losses`` reads, in its order |
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import keras
import tensorflow as tf

from tfmp._src.attachment import record
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import patches
from tfmp._src.keras_hooks.patches import defining_class

Hook = patches.Hook  # what subscribing returns: `.remove()` unsubscribes
SURFACE = patches.Surface("loss terms", methods=("losses",), subscribers=("enable.losses", "numerics"))

#: (class, attribute) pairs that must exist on the installed Keras's classes.
REQUIRED_ATTRIBUTES = ((keras.layers.Layer, "_get_own_losses"), (keras.layers.Layer, "_flatten_layers"))

#: (what tfmp relies on Keras doing, the test that checks it).
CALL_ORDER = (
    ("compute_loss sums `model.losses`, read through the Layer.losses property",
     "tests/test_attachment.py::test_a_model_compiled_while_enabled_sums_its_16_bit_loss_terms_after_disable"),
    ("Layer.losses lists the layer's own terms, then each sublayer's own terms (_flatten_layers order), "
     "then one weight-regularizer term per trainable weight with a regularizer; Layer.__call__ adds the "
     "activity regularizer's term after call returns",
     "tests/test_numerics_backward.py::test_term_sources_follow_keras_order_of_model_losses"),
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


def own_terms(layer: Any) -> List[Any]:
    """The loss terms `layer` itself added this call (``add_loss``, its activity regularizer), in order."""
    return layer._get_own_losses()


def term_sources(layer: Any) -> Optional[List[Tuple[str, Any, Any]]]:
    """Where each term of ``layer.losses`` comes from, in the order Keras lists them.

    Returns:
        List of ``("own", owner, term)`` (a term `owner` added: ``add_loss`` or
        its activity regularizer; `term` is the tensor as Keras holds it) and
        ``("weight", None, variable)`` (the regularizer of a trainable weight),
        one per term; None when the layer's losses are overridden (no source
        is known).
    """
    if getattr(layer, "_losses_override", None):
        return None
    sources: List[Tuple[str, Any, Any]] = [("own", layer, term) for term in own_terms(layer)]
    for sublayer in layer._flatten_layers(include_self=False):
        sources.extend(("own", sublayer, term) for term in own_terms(sublayer))
    sources.extend(("weight", None, variable) for variable in layer.trainable_weights
                   if variable.regularizer is not None)
    return sources


def watch(on_read: Callable[[Any, List[Any]], None]) -> patches.Hook:
    """Calls ``on_read(layer, terms)`` whenever any layer's ``losses`` is read; owner ``"numerics"``.

    `terms` is the list the reader gets (after ``enable.losses``' float32 casts).
    Process-wide while on: the caller keeps it on only while it needs it and
    `on_read` ignores the layers it does not watch.

    Returns:
        `patches.Hook`; remove it to take the watch off.
    """

    def wrap(original: Any) -> property:
        getter: Callable[[Any], List[Any]] = original.fget if isinstance(original, property) else original

        def losses(self: Any) -> List[Any]:
            terms = getter(self)
            on_read(self, terms)
            return terms

        losses.__doc__ = getter.__doc__
        return property(losses)

    return SURFACE.subscribe(defining_class(keras.layers.Layer, "losses"), "losses", wrap, owner="numerics")
