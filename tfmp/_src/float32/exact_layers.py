"""Exact preprocessing layers compute in float32 wherever they run.

`registry.EXACT_PREPROCESSING` layers cast inputs to the compute dtype, in a ``tf.data``
map and in a model alike, which makes their results wrong in 16 bits. While the thread has
a session, their ``__init__`` gives a new layer a float32 policy unless excluded; one made
before `enable()` is forced at ``compile`` (`refresh_state`).
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


def force_if_enabled(layer: keras.layers.Layer) -> None:
    """Sets a float32 policy on a new exact layer made while this thread has a session."""
    state = session.current()
    if (state is None or layer.compute_dtype not in LOW_PRECISION
            or layer.dtype_policy.quantization_mode or registry.exact_reason(layer) is None):
        return
    excluded = tuple(state.exclude_float32) + registry.float32_layers().exclude
    if registry.matches(layer, "", [t for t in excluded if isinstance(t, type)]):  # classes only: no path yet
        return
    _CREATED[layer] = layer.dtype_policy.name
    layer.dtype_policy = "float32"


def unforce(layer: keras.layers.Layer) -> bool:
    """Puts a layer forced when created back to its policy (an exclusion found at compile); True if changed."""
    if not forced_when_created(layer):
        return False
    layer.dtype_policy = _CREATED.pop(layer)
    refresh_state(layer)
    return True


def refresh_state(layer: keras.layers.Layer) -> None:
    """Casts a ``Normalization``'s stored mean and variance again to its current compute dtype."""
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

