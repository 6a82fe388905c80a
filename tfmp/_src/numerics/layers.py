"""Which layers `tfmp.check_numerics` hooks, their paths and float16 hazards, and the loss-scale rule.

The hooks themselves go through the surfaces of `tfmp._src.keras_hooks`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import keras
import tensorflow as tf

from tfmp._src.errors import invalid_argument
from tfmp._src.float32.reductions import wide_reduction
from tfmp._src.float32.unsafe_ops import unsafe_ops
from tfmp._src.layer_tree import is_wiring, walk

LayerSpec = Union[None, Sequence[Union[str, type, keras.layers.Layer]], Callable[[keras.layers.Layer], bool]]


def layer_paths(model: keras.Model) -> list[tuple[keras.layers.Layer, str]]:
    """(layer, path) of every layer of `model`, pre-order, paths as `layer_tree` makes them."""
    return [(entry.layer, entry.path) for entry in walk(model)]


def reduction_hint(model: keras.Model, path: str) -> Optional[str]:
    """The cause and fix of a float16 reduction that can overflow (or an `unsafe_ops` finding) in the layer
    at `path` or, failing that, in the nearest layer enclosing it (a custom block's sublayer is seen in its
    trace), or None."""
    found = None
    for layer, where in layer_paths(model):
        if path == where or path.startswith(where + "/"):
            found = wide_reduction(layer) or unsafe_ops(layer)  # pre-order: the layer itself comes last
    return None if found is None else found.advice(path)


def check_layer_spec(layers: Any) -> None:
    """Checks (`ValueError`) the form of a `layers` argument of `tfmp.check_numerics`, not which exist."""
    if layers is None or isinstance(layers, (str, type, keras.layers.Layer)) or callable(layers):
        return
    expected = ("None (every layer), a callable layer -> bool, or a non-empty list of layer "
                "names, paths, Layer classes or Layer instances")
    fix = "For no forward check at all, pass phase='backward'."
    if not isinstance(layers, (list, tuple, set, frozenset)) or not layers:
        raise invalid_argument("layers", layers, expected, fix=fix)
    for spec in layers:
        if not isinstance(spec, (str, type, keras.layers.Layer)) or spec == "":
            raise invalid_argument("layers", spec, "layer names, paths, Layer classes or Layer instances",
                                   fix="Pass e.g. layers=['dense', keras.layers.LayerNormalization].")


def select_layers(model: keras.Model, layers: LayerSpec) -> list[tuple[keras.layers.Layer, str]]:
    """The layers to hook with their paths, validated (see `check_numerics`)."""
    candidates = [(layer, path) for layer, path in layer_paths(model) if not is_wiring(layer)]
    if layers is None:
        return candidates
    if callable(layers) and not isinstance(layers, type):
        return [(layer, path) for layer, path in candidates if layers(layer)]
    if isinstance(layers, (str, type, keras.layers.Layer)):
        layers = [layers]
    chosen: list[tuple[keras.layers.Layer, str]] = []
    for spec in layers:
        if isinstance(spec, str):
            found = [(layer, path) for layer, path in candidates if spec in (layer.name, path)]
        elif isinstance(spec, type):
            found = [(layer, path) for layer, path in candidates if isinstance(layer, spec)]
        else:  # a Layer instance (`check_layer_spec`)
            found = [(layer, path) for layer, path in candidates if layer is spec]
        if not found:
            names = [layer.name for layer, _ in candidates]
            raise invalid_argument(
                "layers", spec, f"a layer of model '{model.name}' (one of {', '.join(names)})", choices=names,
                fix=(f"Pass names from that list, e.g. layers=[{names[0]!r}]." if names
                     else "The model has no layer yet: build it first, or pass layers=None."),
            )
        chosen.extend(item for item in found if all(item[0] is not c for c, _ in chosen))
    return chosen


def scale_and_counts(optimizer: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """(loss scale before the update, float32; whether a non-finite gradient counts now, bool).

    Under a dynamic scale a non-finite gradient is an overflow the optimizer answers by
    halving the scale, until its floor `max(min_scale, 1)` (1 for Keras's own
    `LossScaleOptimizer`); there scaling magnifies nothing and it is real. Without a
    `LossScaleOptimizer`, or with a fixed scale, every non-finite gradient counts.
    """
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return tf.constant(1.0), tf.constant(True)
    if optimizer.built:
        scale = tf.cast(tf.convert_to_tensor(optimizer.dynamic_scale), tf.float32)
    else:
        scale = tf.constant(float(optimizer.initial_scale))
    floor = max(float(getattr(optimizer, "min_scale", 1.0)), 1.0)
    return scale, scale <= floor
