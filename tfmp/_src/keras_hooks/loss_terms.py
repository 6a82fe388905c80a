"""The loss-terms surface: ``Layer.losses``, read by ``compute_loss``; 16-bit terms cast to float32, each term's source.

Keras's ``compute_loss`` sums the float32 loss with every term of ``model.losses`` in one
``ops.sum``, which fails on a 16-bit term (an ``add_loss`` term, a regularizer's). For an attached
object (decided by its attachment, never the reading thread) ``Layer.losses`` hands 16-bit terms
back cast to float32; terms of a finished trace read eagerly come back as they are.

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

Getter = Callable[[Any], List[Any]]
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


def _subscribe(owner: str, make: Callable[[Getter], Getter]) -> patches.Hook:
    """Hooks ``Layer.losses`` for `owner`: ``make(getter)`` is the new getter over the one below it."""

    def wrap(original: Any) -> property:
        getter = original.fget if isinstance(original, property) else original
        losses = make(getter)
        losses.__doc__ = getter.__doc__
        return property(losses)

    return SURFACE.subscribe(defining_class(keras.layers.Layer, "losses"), "losses", wrap, owner=owner)


def install_losses_hook() -> patches.Hook:
    """Makes ``Layer.losses`` of attached objects hand back 16-bit loss terms cast to float32."""

    def make(getter: Getter) -> Getter:
        def losses(self: Any) -> List[Any]:
            if not record.attached_or_first_use(self):
                return getter(self)
            stale = tf.executing_eagerly()  # read eagerly, a symbolic term is a finished trace's
            return [term if stale and tf.is_symbolic_tensor(term) else to_float32(term) for term in getter(self)]

        return losses

    return _subscribe("enable.losses", make)


def own_terms(layer: Any) -> List[Any]:
    """The loss terms `layer` itself added this call (``add_loss``, its activity regularizer), in order."""
    return layer._get_own_losses()


def term_sources(layer: Any) -> Optional[List[Tuple[str, Any, Any]]]:
    """Where each term of ``layer.losses`` comes from, in Keras's order; None when its losses are overridden.

    Returns:
        List of ``("own", owner, term)`` (``add_loss`` or the activity regularizer of `owner`) and
        ``("weight", None, variable)`` (a trainable weight's regularizer), one per term.
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
    """Calls ``on_read(layer, terms)`` (the list the reader gets) whenever any layer's ``losses`` is read.

    Process-wide while on; owner ``"numerics"``. Remove the returned `patches.Hook` to stop.
    """

    def make(getter: Getter) -> Getter:
        def losses(self: Any) -> List[Any]:
            terms = getter(self)
            on_read(self, terms)
            return terms

        return losses

    return _subscribe("numerics", make)
