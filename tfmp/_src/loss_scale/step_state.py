"""The non-trainable state a training step writes, kept when the step is skipped.

A skipped step must change nothing, but its forward pass has already updated
`keras.layers.BatchNormalization`'s moving mean and variance, which an inf in the batch
turns into NaN for every later prediction. For every BatchNormalization layer attached
to tfmp (`tfmp._src.float32.fused_batchnorm`, either path), `kept_statistics` reads both
statistics before a training call and, after it, (1) writes them back at once where a
new value is not finite and (2) notes them with the model the call runs in, so that a
tfmp optimizer skipping the step (`take`, `put_back`) restores the first value noted for
the models whose variables it updates. With several replicas in sync only (1) applies.
Compiled metrics and random seeds still see the skipped batch. Cost: two reads and two
writes of per-channel vectors per layer and step.
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
_eager = threading.local()  # .noted: this thread's eager pairs since the last `take`
#: Eager pairs kept at most (the oldest go first): eager training calls that no
#: tfmp optimizer follows (a loop with a plain optimizer) must not grow memory.
EAGER_LIMIT = 1024

Noted = List[Tuple[Any, Any, Any]]


def _noted_here() -> Noted:
    """The list of pairs of the graph being traced (kept on the graph), or this thread's eager list."""
    if tf.executing_eagerly():
        noted = getattr(_eager, "noted", None)
        if noted is None:
            noted = _eager.noted = []
        del noted[: max(0, len(noted) - EAGER_LIMIT + 2)]
        return noted
    graph = tf.compat.v1.get_default_graph()
    noted = getattr(graph, _ATTR, None)
    if noted is None:
        noted = []
        setattr(graph, _ATTR, noted)
    return noted


@contextlib.contextmanager
def kept_statistics(layer: Any, training: Any) -> Iterator[None]:
    """Around a BatchNormalization call: non-finite moving statistics are never kept.

    Args:
        layer: A built `keras.layers.BatchNormalization`.
        training: The call's `training` argument; only a Python True with a
            trainable layer updates the statistics.
    """
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
    """The (variable, value before) pairs a skipped step of `trained` must write back.

    Called as `apply` starts, with the variables it updates: the pairs noted in
    this graph and the graphs enclosing it (this thread's eager pairs when
    eager) whose model has one of `trained` among its trainable variables. They
    are taken out; other models' pairs stay for their own optimizer (a GAN's
    two). A step whose forward pass was traced in another function than its
    `apply` is not tied to them (only the layer's own guard, 1 above, applies).
    """
    ids = {id(variable) for variable in trained}
    lists = [getattr(_eager, "noted", None) or []] if tf.executing_eagerly() else []
    lists += [getattr(graph, _ATTR, None) or [] for graph in graph_lineage()]
    taken: List[Tuple[Any, Any]] = []
    verdicts: dict = {}
    for noted in lists:
        kept = []
        for model_ref, variable_ref, old in noted:
            model, variable = model_ref(), variable_ref()
            if model is None or variable is None:
                continue  # gone: nothing to put back
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
    if context is not None and context.num_replicas_in_sync > 1:
        return
    if context is None and tf.distribute.get_strategy().num_replicas_in_sync > 1:
        return
    for variable, old in reversed(noted):  # the first value noted for a variable is written last
        variable.assign(old)
