"""BatchNormalization statistics a skipped step must not keep.

A skipped step's forward pass has already updated the moving mean and variance (an inf in
the batch makes them NaN for good). `kept_statistics` wraps each attached BatchNormalization
training call: non-finite values are written back at once, and the old ones noted so that an
optimizer skipping the step restores them (`take`, `put_back`; one replica only).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, List, Tuple

import tensorflow as tf

from tfmp._src.keras_hooks.layer_calls import entry_layer
from tfmp._src.loss_scale.guard import graph_lineage

_ATTR = "_tfmp_statistics_before"  # on a graph: its noted (model, variable, value before), weakly
_eager = threading.local()  # .noted: this thread's eager notes since the last `take`
#: Eager notes kept at most: eager training calls no tfmp optimizer follows must not grow memory.
EAGER_LIMIT = 1024


def _noted_here() -> list:
    if tf.executing_eagerly():
        noted = vars(_eager).setdefault("noted", [])
        del noted[: max(0, len(noted) - EAGER_LIMIT + 2)]
        return noted
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, _ATTR, None) is None:
        setattr(graph, _ATTR, [])
    return getattr(graph, _ATTR)


@contextlib.contextmanager
def kept_statistics(layer: Any, training: Any) -> Iterator[None]:
    """Around a built BatchNormalization's call: non-finite moving statistics are never kept."""
    if not (training is True and layer.trainable):
        yield
        return
    variables = (layer.moving_mean, layer.moving_variance)
    before = [tf.identity(variable) for variable in variables]  # read before the update
    yield
    after = [tf.identity(variable) for variable in variables]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(value)) for value in after])
    noted = _noted_here()
    model = weakref.ref(entry_layer() or layer)  # a note never keeps a model alive
    for variable, old, new in zip(variables, before, after):
        variable.assign(tf.where(finite, new, old))
        noted.append((model, weakref.ref(variable), old))


def take(trained: List[Any]) -> List[Tuple[Any, Any]]:
    """Takes out the (variable, value before) pairs noted in this step for models training `trained`.

    Other models' notes stay for their own optimizer (a GAN's two).
    """
    ids = {id(variable) for variable in trained}
    lists = [getattr(_eager, "noted", None) or []] if tf.executing_eagerly() else []
    lists += [getattr(graph, _ATTR, None) or [] for graph in graph_lineage()]
    taken, verdicts = [], {}
    for noted in lists:
        kept = []
        for model_ref, variable_ref, old in noted:
            model, variable = model_ref(), variable_ref()
            if model is None or variable is None:
                continue
            if id(model) not in verdicts:
                verdicts[id(model)] = any(id(v) in ids for v in model.trainable_variables)
            if verdicts[id(model)]:
                taken.append((variable, old))
            else:
                kept.append((model_ref, variable_ref, old))
        noted[:] = kept
    return taken


def put_back(noted: List[Tuple[Any, Any]]) -> None:
    """Writes the noted values back (a skipped step's branch); nothing with several replicas."""
    context = tf.distribute.get_replica_context()
    replicas = (context or tf.distribute.get_strategy()).num_replicas_in_sync
    if replicas > 1:
        return
    for variable, old in reversed(noted):  # the first value noted for a variable is written last
        variable.assign(old)
