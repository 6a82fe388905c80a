"""What `tfmp.LossScaleOptimizer` checks before applying a step, and whether the loss was scaled.

Guards (the `guard` argument); a step whose check fails is skipped and counted.
``"batch"`` (no loss scaling): the loss and every gradient finite on every replica, and
the float tensors of the batch `fit` hands to ``train_step`` checked as the step starts
(`tfmp._src.loss_scale.batch_check`), to name a skip's cause (`last_loss_status`).
``"loss"`` (no loss scaling): the loss alone, so no update waits for the backward pass.
``"gradients"``: every gradient finite, what dynamic loss scaling needs. ``"values"``:
the above, then every value the step writes into a trainable variable or the inner
optimizer's variables finite, else all put back (not under ``tf.distribute``).
``"auto"``: ``"gradients"`` with loss scaling, ``"batch"`` without. An `apply` with no
`scale_loss` call recorded for its step (`StepRecord`: a custom loop) gets the gradients
check. `warn_if_unscaled` warns once (`LossScaleWarning`) when gradients reach a
dynamic-scale optimizer whose `scale_loss` never ran. Costs: ``benchmarks/guard_cost.py``.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import tensorflow as tf

from tfmp._src.errors import invalid_argument, user_stacklevel

#: Values of the `guard` argument of `tfmp.LossScaleOptimizer`.
GUARDS = ("auto", "batch", "loss", "gradients", "values")
#: Guards that check the loss (and the batch) instead of the gradients: only without loss scaling.
LOSS_GUARDS = ("batch", "loss")


class LossScaleWarning(UserWarning):
    """Loss scaling is not what the code asked for.

    Warned when gradients reach a loss-scaling optimizer from a loss it did not
    scale; when tfmp replaces a Keras `keras.optimizers.LossScaleOptimizer` given
    to ``compile()`` by its own (`tfmp._src.loss_scale.user_settings`); and when
    loss-scaling settings are given for a model that computes without loss
    scaling (bfloat16, float32), where the scale stays 1.0.

    Make it an error with ``warnings.simplefilter("error", tfmp.LossScaleWarning)``.
    """


def check_guard(guard: Any, loss_scaling: bool) -> None:
    """Validates the `guard` argument against `loss_scaling`.

    Raises:
        ValueError: In the project's template, for an unknown guard, or
            ``"batch"`` / ``"loss"`` together with loss scaling (an overflow shows up only in the
            gradients).
    """
    if guard not in GUARDS:
        raise invalid_argument("guard", guard, "one of " + ", ".join(map(repr, GUARDS)), choices=GUARDS,
                               fix="Pass e.g. guard='auto' (the default: 'gradients' with loss scaling, "
                               "'batch' without).")
    if guard in LOSS_GUARDS and loss_scaling:
        raise invalid_argument(
            "guard", guard, "'auto', 'gradients' or 'values' with loss_scaling=True",
            fix="Dynamic loss scaling detects overflow in the gradients: keep guard='auto' "
            "(or 'values') under mixed_float16, or pass loss_scaling=False (bfloat16, float32).",
        )


def graph_lineage() -> list:
    """The graph being traced and every graph enclosing it, innermost first ([] when eager).

    "This step" for a `tf.function` step: `scale_loss` may run in the train
    function's graph and `apply` in a `cond` branch or a nested function inside it.
    """
    if tf.executing_eagerly():
        return []
    lineage, graph = [], tf.compat.v1.get_default_graph()
    while graph is not None:
        lineage.append(graph)
        graph = getattr(graph, "outer_graph", None)
    return lineage


def resolve(guard: str, loss_scaling: bool) -> str:
    """String, ``"batch"``, ``"loss"``, ``"gradients"`` or ``"values"``: what a `guard` value stands for."""
    if guard == "auto":
        return "gradients" if loss_scaling else "batch"
    return guard


def first_check(guard: str, loss_scaling: bool) -> str:
    """String, ``"batch"``, ``"loss"`` or ``"gradients"``: the check made before the update.

    ``"values"`` checks the batch (or, with loss scaling, the gradients) first and
    the written values after.
    """
    resolved = resolve(guard, loss_scaling)
    if resolved == "values":
        return "gradients" if loss_scaling else "batch"
    return resolved


class ScaleLossCalls:
    """Whether `scale_loss` ran on one optimizer in the step now traced or run.

    A `tf.function` step is traced once, so for a traced step this means "in the
    graph now being traced, or one enclosing it" (a set of graphs, held weakly);
    for an eager step, "since the previous `take`" (a flag).
    """

    def __init__(self) -> None:
        self._graphs: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._eager = False

    def note(self) -> None:
        """Called by `scale_loss`."""
        if tf.executing_eagerly():
            self._eager = True
        else:
            self._graphs.add(tf.compat.v1.get_default_graph())

    def take(self) -> bool:
        """Bool. Called by `apply`: whether `note` was called in this step (eager: clears it)."""
        if tf.executing_eagerly():
            noted, self._eager = self._eager, False
            return noted
        return any(graph in self._graphs for graph in graph_lineage())


class StepRecord:
    """Python-side record of `scale_loss` calls on one optimizer (nothing runs per step).

    A `tf.function` step is traced once: `scale_loss` and `apply` of Keras's
    `train_step` both run while its graph is traced, so "the loss was recorded in
    this step" means "in the graph now being traced, or one enclosing it". An
    eager step means "since the previous eager `apply`" (with one replica; under
    several replicas eager steps get the gradients check).

    Attributes:
        ever: Bool. `scale_loss` ran on this optimizer at least once.
        warned: Bool. `warn_if_unscaled` has warned for this optimizer.
    """

    def __init__(self) -> None:
        self._scaled = ScaleLossCalls()
        self._unscaled = ScaleLossCalls()  # get_unscaled_gradients calls, the same way
        self._batch = threading.local()  # .noted: (graph or None when eager, status tensor)
        self.ever = False
        self.warned = False

    def note_batch(self, status: Any) -> None:
        """Called as a train step starts: `status` is the batch's bits (scalar int64 tensor).

        Kept per thread (a `tf.distribute` strategy traces each replica in its
        own thread) and per graph, for the `scale_loss` of the same step.
        """
        self._batch.noted = (None if tf.executing_eagerly() else tf.compat.v1.get_default_graph(), status)

    def take_batch_status(self) -> Any:
        """The status `note_batch` kept for this step (its graph or one enclosing it), else None."""
        noted = getattr(self._batch, "noted", None)
        self._batch.noted = None
        if noted is None:
            return None
        graph, status = noted
        if tf.executing_eagerly():
            return status if graph is None else None
        return status if any(graph is g for g in graph_lineage()) else None

    def note_scale_loss(self, loss_recorded: bool) -> None:
        """Called by `scale_loss`; `loss_recorded` is whether it stored the loss's status."""
        self.ever = True
        if loss_recorded:
            self._scaled.note()

    def note_unscaled(self) -> None:
        """Called by `get_unscaled_gradients`: this step's gradients were divided by the scale."""
        self._unscaled.note()

    def take_unscaled(self) -> bool:
        """Bool. Called by `apply`: whether `get_unscaled_gradients` ran in this step."""
        return self._unscaled.take()

    def take_loss_recorded(self) -> bool:
        """Bool. Called by `apply`: whether this step's loss status was recorded."""
        recorded = self._scaled.take()
        if tf.executing_eagerly():
            context = tf.distribute.get_replica_context()  # None in a cross-replica context
            return recorded and context is not None and context.num_replicas_in_sync == 1
        return recorded


#: How many ops back from a gradient `GradientOrigins` looks for one `get_unscaled_gradients` saw.
ORIGIN_SEARCH_DEPTH = 8


class GradientOrigins:
    """Which gradients `get_unscaled_gradients` took (scaled) and handed back (unscaled).

    `apply` divides a gradient by the loss scale unless it descends from one
    handed back: the very tensor, or, in a traced step, a tensor up to
    `ORIGIN_SEARCH_DEPTH` ops below one (a ``tf.identity``, a cast, clipping).
    A tensor found nowhere (an eager step's result of an op) counts as unscaled
    when `get_unscaled_gradients` ran in the same step, as in tf.keras 2 code.
    """

    def __init__(self) -> None:
        # Eager tensors by id: True, those handed back (unscaled); False, those taken (scaled).
        self._eager = {True: weakref.WeakValueDictionary(), False: weakref.WeakValueDictionary()}
        self._graphs: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

    def note(self, taken: list, handed_back: list) -> None:
        """Called by `get_unscaled_gradients` with its argument and its result."""
        for tensors, unscaled in ((taken, False), (handed_back, True)):
            for tensor in tensors:
                if tensor is None:
                    continue
                if hasattr(tensor, "graph") and not tf.executing_eagerly():
                    self._graphs.setdefault(tensor.graph, {})[tensor.name] = unscaled
                else:
                    self._eager[unscaled][id(tensor)] = tensor

    def already_unscaled(self, grads: list, unscaled_in_step: bool) -> list:
        """List of bools, one per gradient: True when it must not be divided by the scale again."""
        return [False if g is None else self._origin(g, unscaled_in_step) for g in grads]

    def _origin(self, grad: Any, unscaled_in_step: bool) -> bool:
        for unscaled, tensors in self._eager.items():
            if tensors.get(id(grad)) is grad:
                return unscaled
        names = self._graphs.get(getattr(grad, "graph", None)) if not tf.executing_eagerly() else None
        if names:
            frontier, seen = [grad], set()
            for _ in range(ORIGIN_SEARCH_DEPTH):
                following = []
                for tensor in frontier:
                    if tensor.name in names:
                        return names[tensor.name]
                    if tensor.op.name not in seen:
                        seen.add(tensor.op.name)
                        following += list(tensor.op.inputs)
                frontier = following
        return unscaled_in_step


#: Name scopes of TensorFlow's clipping functions, as their ops are named in a graph.
CLIP_SCOPES = ("clip_by_global_norm", "clip_by_norm", "clip_by_value")
#: How many ops back from a gradient `clipped_while_scaled` looks.
CLIP_SEARCH_DEPTH = 4


def clipped_while_scaled(grads: list) -> str:
    """The clipping op one of `grads` went through, in a traced step, or ``""``.

    Looks up to `CLIP_SEARCH_DEPTH` ops back from each gradient in the graph now
    traced for an op of TensorFlow's clipping functions (`CLIP_SCOPES`, or the
    ``ClipByValue`` kernel). An eager step has no graph to read: ``""``.
    """
    if tf.executing_eagerly():
        return ""
    seen, frontier = set(), [g.op for g in grads if g is not None and hasattr(g, "op")]
    for _ in range(CLIP_SEARCH_DEPTH):
        following = []
        for op in frontier:
            if op.name in seen:
                continue
            seen.add(op.name)
            scopes = op.name.split("/")
            if op.type == "ClipByValue" or any(part.startswith(CLIP_SCOPES) for part in scopes):
                return op.name
            following += [tensor.op for tensor in op.inputs]
        frontier = following
    return ""


@tf.autograph.experimental.do_not_convert  # Python run once per trace, never graph code
def refuse_clipped_scaled(optimizer: Any, grads: list) -> None:
    """Refuses gradients clipped while still multiplied by the loss scale (dynamic loss scaling only).

    Clipping a scaled gradient to a norm of, say, 1.0 and then dividing it by
    the scale (32768 at first) leaves an update about 1/32768 of the intended one,
    silently.

    Raises:
        ValueError: (template, naming `grads`) with the clipping op and the fix.
    """
    if not optimizer.loss_scaling:
        return
    clip = clipped_while_scaled(grads)
    if clip:
        raise invalid_argument(
            "grads", f"gradients clipped by the op {clip} while multiplied by the loss scale",
            "gradients of the scaled loss as the tape returned them, or gradients unscaled before clipping",
            fix="Clip after unscaling: grads = optimizer.get_unscaled_gradients(grads), then clip, then "
            "optimizer.apply(grads, variables) (tfmp divides those by the scale no more); or let the "
            "optimizer clip: keras.optimizers.Adam(global_clipnorm=1.0) inside tfmp.LossScaleOptimizer.")


def warn_if_unscaled(optimizer: Any, record: StepRecord, from_unscale: bool) -> None:
    """Warns once per optimizer when dynamic loss scaling meets gradients of an unscaled loss.

    Silent when the optimizer does not scale (`loss_scaling=False`), when the
    gradients came from `get_unscaled_gradients` (`from_unscale`), or once
    `scale_loss` has run on the optimizer, in any step or function: gradients
    computed in one `tf.function` and applied in another cannot be told apart,
    so only an optimizer that never scaled a loss is reported. Its gradients
    are divided by the scale all the same: Keras's `LossScaleOptimizer.apply`
    does so, and code written for it (a loss multiplied by the scale by hand)
    must train the same.

    Warns:
        tfmp.LossScaleWarning: naming the factor and the fix.
    """
    if not optimizer.loss_scaling or from_unscale or record.ever or record.warned:
        return
    record.warned = True
    with tf.init_scope():
        scale = optimizer.loss_scale
    warnings.warn(
        f"Gradients reached {type(optimizer).__name__} {optimizer.name!r} (dynamic loss "
        f"scaling, scale {scale:g}), but no loss was scaled by it: `apply` divides the "
        f"gradients by the scale, as Keras's LossScaleOptimizer does, so each update is "
        f"{scale:g}x too small and training barely moves. Scale the loss inside the "
        "GradientTape, before tape.gradient: `scaled_loss = self.optimizer.scale_loss(loss)`, "
        "then take the gradients of `scaled_loss` (keep `loss` for the metrics), or `grads = "
        "tfmp.scaled_gradients(tape, loss, variables, optimizer)`. Warned once per "
        "optimizer; make it an error with warnings.simplefilter('error', tfmp.LossScaleWarning).",
        LossScaleWarning,
        stacklevel=user_stacklevel(),
    )
