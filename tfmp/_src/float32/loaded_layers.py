"""A layer saved in float32 rebuilds its sublayers in float32 when loaded while enabled.

A saved file keeps a forced custom layer's policy but its ``__init__`` makes the sublayers
again under the global 16-bit policy. While the thread has a session, Keras's
``from_config`` builds a custom (non-Keras, not excluded) layer whose saved policy
computes in float32 with the global policy set to float32.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import keras

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import layer_calls
from tfmp._src.policy import session


def _computes_in_float32(config: Any) -> bool:
    dtype = config.get("dtype") if isinstance(config, dict) else None
    if dtype is None:
        return False
    try:
        policy = keras.dtype_policies.get(dtype)
    except (ValueError, TypeError):
        return False
    return policy.compute_dtype == "float32" and policy.quantization_mode is None


def _wrap(original: classmethod) -> classmethod:
    from_config: Callable = original.__func__

    @functools.wraps(from_config)
    def tfmp_from_config(cls: type, config: Any) -> Any:
        global_policy = keras.config.dtype_policy()
        current = session.current()
        if (current is None or global_policy.compute_dtype not in LOW_PRECISION
                or cls.__module__.split(".")[0] == "keras"
                or any(isinstance(t, type) and issubclass(cls, t) for t in current.exclude_float32)
                or not _computes_in_float32(config)):
            return from_config(cls, config)
        keras.config.set_dtype_policy("float32")  # Keras's global policy is per thread
        try:
            return from_config(cls, config)
        finally:
            keras.config.set_dtype_policy(global_policy)

    return classmethod(tfmp_from_config)


def install() -> layer_calls.Hook:
    """Hooks the ``from_config`` classmethod every Keras layer inherits; remove the `Hook` to undo."""
    owner = layer_calls.defining_class(keras.layers.Layer, "from_config")
    return layer_calls.subscribe(owner, "from_config", _wrap, owner="float32.from_config")
