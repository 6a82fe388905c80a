"""Exact preprocessing layers compute in float32 wherever they run.

Keras's preprocessing layers cast their inputs to the layer's compute dtype: in a
``tf.data`` map (``DataLayer.__call__`` in a TensorFlow graph) and in a model's
traced call alike. For the layers of `registry.EXACT_PREPROCESSING` that cast
changes the result, not its precision: under ``mixed_bfloat16`` a
``Discretization`` of values around 1,000 over 256 buckets puts 253 of 256 in
the wrong bucket (tensorflow#43502), ``CategoryEncoding`` encodes id 1999 as 2000
(keras#19583), and ``Normalization`` turns 10000.3 into 10048 before subtracting
its mean (keras-core#412).

Such a layer is often never part of a compiled model (``dataset.map(layer)``),
so forcing at ``compile`` cannot reach it. While the calling thread has a
session, the ``__init__`` of each of these classes (owner ``"float32.exact"``, a
session hook installed by `tfmp._src.policy.enable`) gives a new layer a
float32 policy, unless a class the session or the registry excludes matches it.
The policy belongs to the layer, so it holds wherever the layer runs later: in a
model or a ``tf.data`` map, before or after ``compile``, after `tfmp.disable()`.
A layer created before `enable()` with a 16-bit policy is forced at ``compile``
like any other rule's layer, and its state Keras stored in the old compute dtype
is cast again from its float32 source (`refresh_state`).

The dtype it hands on: in a ``tf.data`` map there is no parent, so the layer
returns float32 (or the integers it computes); the model the data feeds casts
its inputs itself. Once a model holding it is compiled, the output-dtype rule
applies as to every forced layer (`tfmp._src.float32.cast_back`): it hands back
its parent's 16-bit dtype, unless it produces a model output (float32). A path
pattern the session excludes (``exclude_float32="prep/*"``) is only known then:
``compile`` puts such a layer back to the policy it was created with.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import keras

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.float32 import registry
from tfmp._src.keras_hooks import layer_calls
from tfmp._src.policy import session

#: Layers this hook set to float32 when they were created -> the policy name they had.
_CREATED: "weakref.WeakKeyDictionary[keras.layers.Layer, str]" = weakref.WeakKeyDictionary()

#: The public classes of `registry.EXACT_PREPROCESSING`, whose ``__init__`` is hooked.
CLASSES = (keras.layers.Discretization, keras.layers.CategoryEncoding, keras.layers.Normalization)


def forced_when_created(layer: keras.layers.Layer) -> bool:
    """True when ``layer`` was set to float32 by this module's hook and still computes in it."""
    return layer in _CREATED and layer.compute_dtype == "float32"


def _excluded_class(layer: keras.layers.Layer, state: session.Session) -> bool:
    """True when a class the session or the registry excludes matches ``layer``."""
    targets = tuple(state.exclude_float32) + registry.float32_layers().exclude
    return registry.matches(layer, "", [t for t in targets if isinstance(t, type)])


def force_if_enabled(layer: keras.layers.Layer) -> None:
    """Sets a float32 policy on a new exact layer made while this thread has a session."""
    state = session.current()
    if (state is None or layer.compute_dtype not in LOW_PRECISION
            or layer.dtype_policy.quantization_mode or registry.exact_reason(layer) is None
            or _excluded_class(layer, state)):
        return
    _CREATED[layer] = layer.dtype_policy.name
    layer.dtype_policy = "float32"


def unforce(layer: keras.layers.Layer) -> bool:
    """Puts a layer forced when created back to its policy (an exclusion found at compile).

    Returns:
        Bool. True when the policy changed.
    """
    if not forced_when_created(layer):
        return False
    layer.dtype_policy = _CREATED.pop(layer)
    refresh_state(layer)
    return True


def refresh_state(layer: keras.layers.Layer) -> None:
    """Casts again, to the layer's current compute dtype, the state Keras stored in the old one.

    Of the exact layers only ``Normalization`` keeps such state: the mean and
    variance its ``build`` (given ``mean``/``variance``) or ``finalize_state``
    (after ``adapt``, from its float32 variables) cast to the compute dtype. Keras
    does the same again here through public methods; other layers are left alone.
    """
    if not isinstance(layer, keras.layers.Normalization) or not layer.built:
        return
    if layer.input_mean is not None:
        layer.build_from_config(layer.get_build_config())
    else:
        layer.finalize_state()


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        force_if_enabled(self)

    return __init__


def install() -> None:
    """Hooks the ``__init__`` of each class of `CLASSES` (through `layer_calls.subscribe`)."""
    for cls in CLASSES:
        layer_calls.subscribe(cls, "__init__", _wrap, owner="float32.exact")

