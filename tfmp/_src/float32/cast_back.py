"""What a forced layer hands back: its parent's 16-bit dtype, or float32 for a model output.

``"float32.cast_back"`` casts a forced layer's floating outputs to its parent's 16-bit
compute dtype (read at each call). ``"float32.outputs"`` casts a subclassed model's or
output block's 16-bit outputs to float32, taking back a forced sublayer's float32 result
where the output is exactly what that sublayer handed back.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import keras

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.keras_hooks import layer_calls
from tfmp._src.keras_hooks.object_state import PerObject
from tfmp._src.keras_hooks.loss_terms import to_float32

#: Forced layers handing back their parent's dtype: layer -> [call hook, spec hook, target].
_CAST_BACK = PerObject("cast_back")
_local = threading.local()


class _ModelCall:
    """One running call of a hooked subclassed model: the casts its direct sublayers made."""

    def __init__(self, model: keras.Model):
        self.model = model
        #: id of the 16-bit tensor handed back -> (that tensor, the float32 one it came from)
        self.kept: Dict[int, Tuple[Any, Any]] = {}

    def output(self, x):
        """``x`` in float32: the kept float32 original when ``x`` is a handed-back cast."""
        pair = self.kept.get(id(x))
        if pair is not None and pair[0] is x:
            return pair[1]
        return to_float32(x)


def _running_calls() -> List[_ModelCall]:
    return vars(_local).setdefault("calls", [])


def casts_back(layer: keras.layers.Layer) -> bool:
    """True when ``layer``'s outputs are cast to its parent's 16-bit compute dtype."""
    return layer in _CAST_BACK


def handed_back_dtype(layer: keras.layers.Layer) -> Optional[str]:
    """The 16-bit dtype ``layer``'s cast-back hook casts to now, or None (no cast)."""
    hooks = _CAST_BACK.get(layer)
    return hooks[2]() if hooks else None


def cast_float(x, dtype: str):
    """``x`` cast to ``dtype`` when it is a floating tensor of another dtype."""
    own = getattr(x, "dtype", None)
    if own is None or not keras.backend.is_float_dtype(own) or keras.backend.standardize_dtype(own) == dtype:
        return x
    if isinstance(x, keras.KerasTensor):
        return keras.KerasTensor(x.shape, dtype=dtype, sparse=x.sparse)
    return keras.ops.cast(x, dtype)


def install(layer: keras.layers.Layer, parent, only: Optional[Callable[[tuple, dict], bool]] = None,
            dtypes: Tuple[str, ...] = LOW_PRECISION) -> None:
    """Hooks ``layer.call`` and ``compute_output_spec`` to hand back ``parent``'s compute dtype when it is
    one of ``dtypes`` (a forced layer: 16-bit; a 16-bit expert of a forced MoE: float32), where `only` says."""
    if layer in _CAST_BACK or parent is None:
        return
    parent_ref = weakref.ref(parent)

    def target() -> Optional[str]:
        owner = parent_ref()
        dtype = getattr(owner, "compute_dtype", None)
        return dtype if dtype in dtypes else None

    def wrap(original):
        @functools.wraps(original)
        def cast_back(*args, **kwargs):
            outputs = original(*args, **kwargs)
            dtype = target()
            if dtype is None or only is not None and not only(args, kwargs):
                return outputs
            cast = keras.tree.map_structure(lambda x: cast_float(x, dtype), outputs)
            calls = _running_calls()
            if calls and calls[-1].model is parent_ref():
                for new, old in zip(keras.tree.flatten(cast), keras.tree.flatten(outputs)):
                    if new is not old:
                        calls[-1].kept[id(new)] = (new, old)
            return cast

        return cast_back

    _CAST_BACK[layer] = [
        layer_calls.subscribe(layer, "call", wrap, owner="float32.cast_back"),
        layer_calls.subscribe(layer, "compute_output_spec", wrap, owner="float32.cast_back"),
        target,
    ]


def remove(layer: keras.layers.Layer) -> None:
    """Takes ``layer``'s cast-back hooks off (it now produces a model output)."""
    for hook in _CAST_BACK.pop(layer, [])[:2]:
        hook.remove()


def cast_outputs(model: keras.layers.Layer, only: Optional[Callable[[tuple, dict], bool]] = None) -> bool:
    """Hooks ``model.call`` (a layer's ``compute_output_spec`` too) to return float32 on the calls `only` selects;
    False if already hooked."""
    if layer_calls.subscribed(model, "call", "float32.outputs"):
        return False
    model_ref = weakref.ref(model)

    def wrap(original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            if only is not None and not only(args, kwargs):
                return original(*args, **kwargs)
            running = _ModelCall(model_ref())
            calls = _running_calls()
            calls.append(running)
            try:
                outputs = original(*args, **kwargs)
            finally:
                calls.pop()
            return keras.tree.map_structure(running.output, outputs)

        return call

    layer_calls.subscribe(model, "call", wrap, owner="float32.outputs")
    if not isinstance(model, keras.Model):
        layer_calls.subscribe(model, "compute_output_spec", wrap, owner="float32.outputs")
    return True
