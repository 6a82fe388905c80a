"""The non-trainable state a training step writes, kept when the step is skipped.

A step that `tfmp.LossScaleOptimizer` skips must change nothing. Its weights and
optimizer slots are never written (the inner optimizer's `apply` does not run),
but the forward pass has already written one kind of state by then:
`keras.layers.BatchNormalization`'s moving mean and moving variance, updated in
``call`` during training. A batch holding an inf turns them into NaN, and every
later prediction with them is NaN (PyTorch's GradScaler leaves the same hole).

For every BatchNormalization layer attached to tfmp (the layer hook of
`tfmp._src.float32.fused_batchnorm`, Keras's path and the fused kernel alike),
`kept_statistics` reads both statistics before the layer's training call and,
after it:

1. writes back the values read before when a new value is not finite (this
   layer alone, at once: with a tfmp optimizer or without one);
2. notes the values read before for this thread's step; a tfmp optimizer that
   skips the step (`take` as `apply` starts, `put_back` in the skip branch) writes
   them back, so a step skipped for a gradient overflow leaves the statistics
   as they were too.

With several replicas in sync (`tf.distribute`) only 1 applies. Other state a
step changes is left as Keras has it: the compiled metrics see the skipped
batch (the loss in the history is the non-finite value that explains the skip)
and random seeds advance. Cost: two reads and two writes of per-channel vectors
per BatchNormalization layer and step.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, List, Tuple

import tensorflow as tf

_ATTR = "_tfmp_statistics_before"  # on a graph: its noted (variable, value before) pairs
_eager = threading.local()  # .noted: this thread's eager pairs since the last `take`
#: Eager pairs kept at most (the oldest go first): eager training calls that no
#: tfmp optimizer follows (a loop with a plain optimizer) must not grow memory.
EAGER_LIMIT = 1024

Noted = List[Tuple[Any, Any]]


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
    for variable, old, new in zip(variables, before, after):
        variable.assign(tf.where(finite, new, old))
        noted.append((variable, old))


def take() -> Noted:
    """The (variable, value before) pairs noted for the step now traced or run; forgets all.

    Called as `apply` starts: the pairs of this graph and of the graphs
    enclosing it, or this thread's eager pairs when eager. A step whose forward
    pass was traced in another function than its `apply` is not tied to them
    (only the layer's own guard, 1 above, applies).
    """
    if tf.executing_eagerly():
        noted, _eager.noted = getattr(_eager, "noted", None) or [], []
        return noted
    taken: Noted = []
    current = tf.compat.v1.get_default_graph()
    while current is not None:
        taken += getattr(current, _ATTR, None) or []
        if getattr(current, _ATTR, None):
            setattr(current, _ATTR, [])
        current = getattr(current, "outer_graph", None)
    return taken


def put_back(noted: Noted) -> None:
    """Writes the noted values back (a skipped step's branch); nothing with several replicas."""
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        return
    if context is None and tf.distribute.get_strategy().num_replicas_in_sync > 1:
        return
    for variable, old in noted:
        variable.assign(old)
