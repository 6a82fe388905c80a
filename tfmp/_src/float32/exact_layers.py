"""Exact preprocessing layers compute in float32 wherever they run.

Keras's preprocessing layers cast their inputs to the compute dtype, in a ``tf.data`` map
and in a model alike; for `registry.EXACT_PREPROCESSING` that changes the result: under
``mixed_bfloat16`` a ``Discretization`` of values around 1,000 over 256 buckets puts 253
in the wrong bucket (tensorflow#43502), ``CategoryEncoding`` encodes id 1999 as 2000
(keras#19583), ``Normalization`` turns 10000.3 into 10048 (keras-core#412). While the
thread has a session, the ``__init__`` of these classes (owner ``"float32.exact"``) gives
a new layer a float32 policy unless excluded, which holds wherever it runs (a
``dataset.map`` no model reaches, after `tfmp.disable()`). One made before `enable()` is
forced at ``compile``, its stored state cast again from float32 (`refresh_state`). In a
``tf.data`` map it returns float32; in a model the output-dtype rule applies
(`tfmp._src.float32.cast_back`); a path excluded at ``compile`` gets its first policy back.
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

