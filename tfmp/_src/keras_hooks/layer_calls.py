"""The layer surface: the ``Layer`` methods tfmp hooks (`SURFACE`) and the private layer state it reads.

| private name used | where in Keras | what tfmp does with it |
|---|---|---|
| ``Layer._flatten_layers`` | ``keras/src/layers/layer.py`` | `child_layers`: the direct sublayers of a layer, tracked attributes included |
| ``global_state`` attribute ``"current_call_ctx"`` (``CallContext.entry_layer``) | ``keras/src/layers/layer.py`` | `entry_layer`: the outermost layer whose call is running in this thread |
| ``global_state`` attribute ``"name_scope_stack"`` (each ``name_scope``'s ``caller``) | ``keras/src/backend/common/name_scope.py``, ``Layer._open_name_scope`` | `calling_layer`: the innermost layer whose call is running in this thread |
| ``Layer._convert_input_args`` | ``keras/src/layers/layer.py`` | `autocasts_inputs`: whether ``__call__`` casts float inputs |
| ``Layer._build_shapes_dict``, ``Layer._tracker`` | ``keras/src/layers/layer.py`` | `build_state_restored_on_error`: a failed first call leaves the layer unbuilt |
| ``backend.common.masking.get_keras_mask`` / ``set_keras_mask`` | ``keras/src/backend/common/masking.py`` | `carry_mask`: a tensor tfmp puts in place of a layer's input keeps its mask; `keras_mask`, `with_keras_mask`: a chunked cross-entropy reads its logits' mask and hands its per-example losses to ``Loss.__call__`` with it |
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import keras
import tensorflow as tf

from tfmp._src.keras_hooks import patches

SURFACE = patches.Surface(
    "layer calls",
    methods=("call", "build", "compute_output_spec", "__init__", "from_config", "convert_input", "get_config"),
    subscribers=("fused_batchnorm", "float32.build", "float32.exact", "float32.from_config",
                 "float32.outputs", "float32.cast_back", "float32.ids", "enable.dtype_errors",
                 "numerics", "enable.build_errors", "audit.outputs", "float32.regularizer", "attachment"),
)
subscribe = SURFACE.subscribe
defining_class = patches.defining_class
subscribed = SURFACE.subscribed

#: (class, attribute) pairs that must exist on the installed Keras's classes.
REQUIRED_ATTRIBUTES = ((keras.layers.Layer, "_flatten_layers"),)

#: (class whose method is hooked, method, the parameters tfmp relies on, in order).
SIGNATURES: Tuple[Tuple[type, str, Tuple[str, ...]], ...] = (
    # fused_batchnorm: `call(inputs, training=None, mask=None)`.
    (keras.layers.BatchNormalization, "call", ("inputs", "training", "mask")),
    # token_ids: `Embedding.call(inputs)`, `DTypePolicy.convert_input(x, autocast, dtype)`.
    (keras.layers.Embedding, "call", ("inputs",)),
    (keras.DTypePolicy, "convert_input", ("x", "autocast", "dtype")),
    # float32.build: `build(input_shape)`; float32.from_config: `from_config(config)`.
    (keras.layers.Layer, "build", ("input_shape",)),
    (keras.layers.Layer, "from_config", ("config",)),
    # float32.outputs: a tied embedding's `call(inputs, reverse=False)` and
    # `compute_output_spec(inputs, reverse=False)`, cast only when projecting (Keras >= 3.13).
    *((cls, method, ("inputs", "reverse")) for cls in (getattr(keras.layers, "ReversibleEmbedding", None),)
      if cls is not None for method in ("call", "compute_output_spec")),
)

#: (what tfmp relies on Keras doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = (
    ("Layer.__call__ adds activity_regularizer(output) as a loss term, reading the attribute at each "
     "call; get_config serializes that attribute",
     "tests/test_activity_regularizer.py::test_plain_keras_float16_regularizer_overflows_so_tfmp_computes_it_in_float32"),
    ("load_model makes each layer with from_config before calling it symbolically",
     "tests/test_attachment.py::test_a_custom_layer_producing_an_output_loads_while_enabled"),
    ("Layer.__call__ calls the instance's call, inside Keras's call context naming the entry layer",
     "tests/test_attachment.py::test_a_sublayer_made_after_attaching_takes_its_models_attachment_in_any_thread"),
    ("BatchNormalization.call writes the moving statistics during a training call, before optimizer.apply",
     "tests/test_safety.py::test_a_gradient_overflow_skip_puts_the_statistics_back"),
    ("Normalization casts its mean and variance to the compute dtype in build (given) or "
     "finalize_state (adapted, from float32 variables); calling them again after a policy "
     "change casts them again (exact_layers.refresh_state)",
     "tests/test_public_bug_kinds_exact.py::"
     "test_exact_layers_made_before_enable_are_forced_at_compile_with_their_state_cast_again"),
    ("Operation.__new__ reads a layer class's __init__ signature (getfullargspec), which a "
     "hooked __init__'s pass-through carries as __signature__",
     "tests/test_public_bug_kinds_exact.py::"
     "test_the_rule_forces_exact_layers_made_while_enabled_unless_excluded"),
    ("Layer.__call__ runs call inside backend.name_scope(layer.name, caller=layer), on the "
     "thread's name_scope_stack (layer_calls.calling_layer)",
     "tests/test_gelu.py::test_an_attached_model_keeps_its_gelu_inside_a_model_tfmp_did_not_attach"),
)


def child_layers(layer: Any) -> List[Any]:
    """The direct sublayers of `layer` in order, those in attributes, lists and dicts included (Keras's tracking)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def entry_layer() -> Optional[Any]:
    """The outermost layer (usually the model) whose ``__call__`` runs in this thread, or None."""
    from keras.src.backend.common import global_state

    return getattr(global_state.get_global_attribute("current_call_ctx"), "entry_layer", None)


def calling_layer() -> Optional[Any]:
    """The innermost layer whose ``__call__`` runs in this thread (its ``name_scope``'s ``caller``), or None."""
    from keras.src.backend.common import global_state

    for scope in reversed(global_state.get_global_attribute("name_scope_stack") or []):
        caller = getattr(scope, "caller", None)
        if isinstance(caller, keras.layers.Layer):
            return caller
    return None


def carry_mask(source: Any, target: Any) -> Any:
    """`target` given `source`'s Keras mask, if any: a tensor tfmp puts in place of a layer's input keeps it."""
    from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

    mask = get_keras_mask(source)
    if mask is not None:
        set_keras_mask(target, mask)
    return target


def keras_mask(tensor: Any) -> Any:
    """The Keras mask `tensor` carries (a boolean tensor), or None."""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)


def with_keras_mask(tensor: Any, mask: Any) -> Any:
    """`tensor` carrying the Keras mask `mask` (None: left as it is), as ``Loss.__call__`` reads it."""
    from keras.src.backend.common.masking import set_keras_mask

    if mask is not None:
        set_keras_mask(tensor, mask)
    return tensor


def autocasts_inputs(layer: Any) -> bool:
    """Bool. True when `layer.__call__` casts floating inputs to its compute dtype."""
    return bool(isinstance(layer, keras.layers.Layer) and layer._convert_input_args and layer.autocast)


@contextlib.contextmanager
def build_state_restored_on_error(layer: Any) -> Iterator[None]:
    """Puts `layer`'s build state back if the block raises having created no variable.

    Keras marks a layer built, records its input shapes (saved) and locks its tracker before
    ``call`` runs; a failed first call would leave ``{"input_shape": None}``, which no load can
    build from. With variables created, the layer stays built (building again would duplicate them).
    """
    built, shapes, locked = layer.built, layer._build_shapes_dict, layer._tracker.locked
    created: List[Any] = []

    def remember(next_creator: Any, **kwargs: Any) -> Any:
        created.append(next_creator(**kwargs))
        return created[-1]

    try:
        with tf.variable_creator_scope(remember):
            yield
    except BaseException:
        if not created:
            layer.built, layer._build_shapes_dict = built, shapes
            if not locked:
                layer._tracker.unlock()
        raise
