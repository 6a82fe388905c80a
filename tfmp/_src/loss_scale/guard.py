"""What `tfmp.LossScaleOptimizer` checks before applying a step, and whether the loss was scaled.

Guards: ``"batch"`` (no loss scaling: loss, gradients and, to name a skip's cause, the
batch), ``"loss"`` (no loss scaling: the loss alone), ``"gradients"``, ``"values"`` (then
every value the step writes, else all put back), ``"auto"``. An `apply` with no `scale_loss`
in its step gets the gradients check.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator

import numpy as np
import tensorflow as tf

from tfmp._src.errors import invalid_argument, warn
from tfmp._src.keras_hooks import error_texts

#: Values of the `guard` argument of `tfmp.LossScaleOptimizer`.
GUARDS = ("auto", "batch", "loss", "gradients", "values")
#: Guards that check the loss instead of the gradients: only without loss scaling.
LOSS_GUARDS = ("batch", "loss")
#: How many ops back from a gradient `GradientOrigins` looks for one `get_unscaled_gradients` saw.
ORIGIN_SEARCH_DEPTH = 8
#: Name scopes of TensorFlow's clipping functions, as their ops are named in a graph.
CLIP_SCOPES = ("clip_by_global_norm", "clip_by_norm", "clip_by_value")
#: How many ops back from a gradient `clipped_while_scaled` looks.
CLIP_SEARCH_DEPTH = 4
#: Eager: relative round-off within which gradients still match what `tfmp.scaled_gradients` handed out,
#: shrunk or cut (a float32 copy; a float16 cast rounds by 2**-11).
MATCH_TOLERANCE = 1e-3
#: Eager: the least relative shrink or cut that counts as a clip (more than any cast's rounding).
LEAST_CUT = 1e-2


class LossScaleWarning(UserWarning):
    """Loss scaling is not what the code asked for.

    Warned when gradients reach a loss-scaling optimizer from a loss it did not scale;
    when tfmp replaces a `keras.optimizers.LossScaleOptimizer` given to ``compile()``;
    and when loss-scaling settings are given for a model computing in bfloat16 or
    float32, where the scale stays 1.0.

    Make it an error with ``warnings.simplefilter("error", tfmp.LossScaleWarning)``.
    """


def check_guard(guard: Any, loss_scaling: bool) -> None:
    """Raises ValueError (template) for an unknown guard, or ``"batch"`` / ``"loss"`` with loss scaling."""
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


def resolve(guard: str, loss_scaling: bool) -> str:
    """String, ``"batch"``, ``"loss"``, ``"gradients"`` or ``"values"``: what a `guard` value stands for."""
    return ("gradients" if loss_scaling else "batch") if guard == "auto" else guard


def graph_lineage() -> list:
    """The graph being traced and every graph enclosing it, innermost first ([] when eager): "this step"
    for a traced step, whose `apply` may run in a `cond` branch or nested function of `scale_loss`'s graph."""
    if tf.executing_eagerly():
        return []
    lineage, graph = [], tf.compat.v1.get_default_graph()
    while graph is not None:
        lineage.append(graph)
        graph = getattr(graph, "outer_graph", None)
    return lineage


class ScaleLossCalls:
    """Whether a call was noted in the step now traced (this graph or one enclosing it) or, eager,
    since the previous `take`."""

    def __init__(self) -> None:
        self._graphs: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._eager = False

    def note(self) -> None:
        if tf.executing_eagerly():
            self._eager = True
        else:
            self._graphs.add(tf.compat.v1.get_default_graph())

    def take(self) -> bool:
        """Bool: whether `note` was called in this step (eager: clears it)."""
        if tf.executing_eagerly():
            noted, self._eager = self._eager, False
            return noted
        return any(graph in self._graphs for graph in graph_lineage())


class StepRecord:
    """Python-side record of one optimizer's steps: `unscaled` notes `get_unscaled_gradients`;
    `ever`, `scale_loss` ran once; `warned`, `warn_if_unscaled` warned."""

    def __init__(self) -> None:
        self._scaled = ScaleLossCalls()  # scale_loss calls that recorded the loss's status
        self.unscaled = ScaleLossCalls()
        self._batch = threading.local()  # .noted: (graph or None when eager, status)
        self.ever = False
        self.warned = False
        self.handed_out: list = []  # eager: the gradients `tfmp.scaled_gradients` handed out, until `apply`

    def note_handed_out(self, grads: list) -> None:
        """Called by `tfmp.scaled_gradients` with the scaled gradients it returns; kept only when eager,
        where no graph shows what was done to them before `apply` (`cut_while_scaled`)."""
        self.handed_out = list(grads) if tf.executing_eagerly() else []

    def take_handed_out(self) -> list:
        """Called by `apply`: the gradients `note_handed_out` kept (then forgotten), else []."""
        handed_out, self.handed_out = self.handed_out, []
        return handed_out

    def note_batch(self, status: Any) -> None:
        """As a train step starts: `status` is the batch's (nan, inf) scalar bool tensors."""
        self._batch.noted = (None if tf.executing_eagerly() else tf.compat.v1.get_default_graph(), status)

    def take_batch_status(self) -> Any:
        """The status `note_batch` kept for this step (its graph or one enclosing it), else None."""
        noted, self._batch.noted = getattr(self._batch, "noted", None), None
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

    def take_loss_recorded(self) -> bool:
        """Bool. Called by `apply`: whether this step's loss status was recorded (eager: with one replica)."""
        recorded = self._scaled.take()
        if tf.executing_eagerly():
            context = tf.distribute.get_replica_context()  # None in a cross-replica context
            return recorded and context is not None and context.num_replicas_in_sync == 1
        return recorded


class GradientOrigins:
    """Which gradients `get_unscaled_gradients` took (scaled) and handed back (unscaled): `apply` divides
    a gradient unless it is, or traced descends within `ORIGIN_SEARCH_DEPTH` ops from, one handed back."""

    def __init__(self) -> None:
        # Eager tensors by id: True, handed back (unscaled); False, taken (scaled).
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
        for tensor in _back([grad], ORIGIN_SEARCH_DEPTH) if names else ():
            if tensor.name in names:
                return names[tensor.name]
        return unscaled_in_step  # found nowhere: unscaled if `get_unscaled_gradients` ran (tf.keras 2 code)


def _back(tensors: list, depth: int, expand: Any = None) -> Iterator[Any]:
    """`tensors`, then the inputs of their ops, breadth first, `depth` levels (each op expanded once;
    with `expand`, only the ops it accepts)."""
    seen = set()
    for _ in range(depth):
        following = []
        for tensor in tensors:
            yield tensor
            if tensor.op.name not in seen and (expand is None or expand(tensor.op)):
                seen.add(tensor.op.name)
                following += list(tensor.op.inputs)
        tensors = following


def _after_backward_pass(op: Any) -> bool:
    """Whether `op` is outside the backward pass (`error_texts.in_backward_pass`): the user's own op."""
    return not error_texts.in_backward_pass(op.name)


def clipped_while_scaled(grads: list) -> str:
    """The name of a clipping op (`CLIP_SCOPES` or ``ClipByValue``) up to `CLIP_SEARCH_DEPTH` ops
    back from one of `grads` in the graph now traced, or ``""`` (always when eager).

    The walk stops at the backward pass (`error_texts.in_backward_pass`): only ops applied to the gradients
    after the tape count, never the gradient of a clip in the forward pass (a loss's own
    ``clip_by_value`` of probabilities) nor a forward op the backward pass reads."""
    if tf.executing_eagerly():
        return ""
    for tensor in _back([g for g in grads if g is not None and hasattr(g, "op")], CLIP_SEARCH_DEPTH,
                        _after_backward_pass):
        op = tensor.op
        if not _after_backward_pass(op):
            continue
        if op.type == "ClipByValue" or any(part.startswith(CLIP_SCOPES) for part in op.name.split("/")):
            return op.name
    return ""


def cut_while_scaled(handed_out: list, grads: list) -> str:
    """Eager: how one of `grads` was clipped from the scaled gradient at its place in `handed_out`
    (`tfmp.scaled_gradients`' result): shrunk by one factor below 1 (`tf.clip_by_global_norm`,
    `tf.clip_by_norm`) or cut at bounds it exceeded (`tf.clip_by_value`); ``""`` when none was.

    A gradient that is the handed-out tensor costs nothing; a non-finite one (a step to skip) is not read."""
    if len(handed_out) != len(grads):
        return ""
    for position, (given, got) in enumerate(zip(handed_out, grads)):
        if given is None or got is None or got is given or tuple(given.shape) != tuple(np.shape(got)):
            continue
        given, got = np.asarray(given, "float64").ravel(), np.asarray(got, "float64").ravel()
        if not given.size or np.array_equal(given, got) or not np.isfinite(given).all() or not np.isfinite(got).all():
            continue
        largest = max(np.abs(given).max(), np.finfo("float32").tiny)
        factor = float(np.dot(got, given) / max(np.dot(given, given), np.finfo("float64").tiny))
        if factor < 1.0 - LEAST_CUT and np.allclose(got, factor * given, rtol=MATCH_TOLERANCE,
                                                    atol=MATCH_TOLERANCE * largest):
            return f"a factor of {factor:.3g} applied to gradient {position} after tfmp.scaled_gradients"
        low, high = got.min(), got.max()
        if ((given < low - LEAST_CUT * largest).any() or (given > high + LEAST_CUT * largest).any()) and np.allclose(
                got, np.clip(given, low, high), rtol=MATCH_TOLERANCE, atol=MATCH_TOLERANCE * largest):
            return f"a cut at [{low:.3g}, {high:.3g}] of gradient {position} after tfmp.scaled_gradients"
    return ""


@tf.autograph.experimental.do_not_convert  # Python run once per trace, never graph code
def refuse_clipped_scaled(optimizer: Any, grads: list, handed_out: list = ()) -> None:
    """Raises ValueError (template) for gradients clipped while still scaled (dynamic scaling only):
    the update would silently be about 1/scale of the intended one. Traced: a clipping op after the
    tape (`clipped_while_scaled`); eager: `grads` clipped from `handed_out` (`cut_while_scaled`)."""
    clip = ""
    if optimizer.loss_scaling and tf.executing_eagerly():
        clip = cut_while_scaled(list(handed_out), grads)
    elif optimizer.loss_scaling:
        op_name = clipped_while_scaled(grads)
        clip = f"the op {op_name}" if op_name else ""
    if clip:
        raise invalid_argument(
            "grads", f"gradients clipped by {clip} while multiplied by the loss scale",
            "gradients of the scaled loss as the tape returned them, or gradients unscaled before clipping",
            fix="Clip after unscaling: grads = optimizer.get_unscaled_gradients(grads), then clip, then "
            "optimizer.apply(grads, variables) (tfmp divides those by the scale no more); or let the "
            "optimizer clip: keras.optimizers.Adam(global_clipnorm=1.0) inside tfmp.LossScaleOptimizer.")


def warn_if_unscaled(optimizer: Any, record: StepRecord, from_unscale: bool) -> None:
    """Warns (`LossScaleWarning`) once when gradients not from `get_unscaled_gradients` reach a dynamic-scale
    optimizer that never scaled a loss (one that did cannot tell another function's gradients apart)."""
    if not optimizer.loss_scaling or from_unscale or record.ever or record.warned:
        return
    record.warned = True
    with tf.init_scope():
        scale = optimizer.loss_scale
    warn(f"Gradients reached {type(optimizer).__name__} {optimizer.name!r} (scale {scale:g}), but it scaled no loss.",
         f"`apply` divides them by the scale, as Keras's LossScaleOptimizer does: each update is {scale:g}x too small.",
         "Fix: scaled_loss = self.optimizer.scale_loss(loss) in the tape, or grads = tfmp.scaled_gradients(...).",
         LossScaleWarning, section="loss-scaling-in-a-custom-train_step")
