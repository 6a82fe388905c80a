"""In-graph bookkeeping for `tfmp.check_numerics`: what a train step saw, and its first failure.

Variables rather than an op that raises: `tf.debugging.check_numerics` names an op, not a
layer, and `tf.py_function` does not compile under XLA. Each hooked call is reduced to a row
of six float32 numbers (`COLUMNS`); at the step's end the first non-finite row, with the rows
before it, is written to variables. Every checked tensor goes through `tf.stop_gradient`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import keras
import tensorflow as tf

from tfmp._src.distribute import gather_replicas, replica_local_variable
from tfmp._src.numerics.backward import keep_nan, max_magnitude, nan_max

#: Columns of one trace row (float32): the range of |output| and the signed range of the inputs.
#: A range shows any non-finite value (NaN said explicitly: `backward.keep_nan`); a row
#: with non-finite inputs counts too: the first layer to *see* a bad value is named (ReLU hides NaN).
COLUMNS = ("valid", "abs_min", "abs_max", "in_min", "in_max", "has_input")
VALID, ABS_MIN, ABS_MAX, IN_MIN, IN_MAX, HAS_INPUT = range(len(COLUMNS))
#: Entries of the int64 `state` variable.
KIND, STEP, PHASE, INDEX, BAD_GRADS = range(5)
#: Phase codes in `state[PHASE]`, with what `state[INDEX]` counts: a layer output, loss term
#: or the loss (FORWARD, a trace row); the non-finite gradient nearest the loss (BACKWARD, a
#: variable); a layer's backward pass that made a gradient non-finite (LAYER_BACKWARD, a
#: `backward.Boundary`); a call whose output gradient arrived non-finite (ABOVE, a boundary).
FORWARD, BACKWARD, LAYER_BACKWARD, ABOVE = 1, 2, 3, 4
#: Entries of the `boundary` variable: max |gradient| of the call's outputs, inputs, weights.
OUT_GRAD, IN_GRAD, WEIGHT_GRAD = range(3)
LOSS_ENTRY = "loss"


def _tensors(structure: Any, integers: bool) -> list[tf.Tensor]:
    """Dense float tensors in `structure` (integer ones too when `integers`)."""
    found = []
    for value in tf.nest.flatten(structure, expand_composites=False):
        if isinstance(value, keras.Variable):
            value = value.value
        if not isinstance(value, (tf.Tensor, tf.Variable)):
            continue
        dtype = value.dtype
        if 0 in (value.shape.as_list() if value.shape.rank is not None else ()):
            continue  # statically empty: a min/max over it would be +-inf
        if dtype.is_floating or (integers and dtype.is_integer):
            found.append(tf.stop_gradient(value))
    return found


def _range(tensors: list[tf.Tensor], magnitude: bool) -> tf.Tensor:
    """Float32 `[min, max]` over all `tensors` (of their absolute values if `magnitude`)."""
    pairs = []
    for tensor in tensors:
        values = tf.abs(tensor) if magnitude else tensor
        pairs.append(tf.cast(keep_nan(values, tf.stack([tf.reduce_min(values), tf.reduce_max(values)])), tf.float32))
    if len(pairs) == 1:
        return pairs[0]
    stacked = tf.stack(pairs)
    return keep_nan(stacked, tf.stack([tf.reduce_min(stacked[:, 0]), tf.reduce_max(stacked[:, 1])]))


def entry_row(outputs: Any, inputs: Any = None) -> Optional[tf.Tensor]:
    """Float32 `[len(COLUMNS)]` row of one layer call (or the loss), None when `outputs` holds no
    non-empty float tensor. `inputs` is the layer's first argument."""
    outs = _tensors(outputs, integers=False)
    if not outs:
        return None
    ins = _tensors(inputs, integers=True)
    one = tf.ones([1])
    in_range = _range(ins, magnitude=False) if ins else tf.zeros([2])
    return tf.concat([one, _range(outs, magnitude=True), in_range, one if ins else tf.zeros([1])], axis=0)


def row_kinds(rows: tf.Tensor, first: int, last: int) -> tf.Tensor:
    """Kind bits (int64, 1 NaN, 2 inf, 3 both) of columns `first:last` of each row."""
    values = rows[:, first:last]
    return _kind_bits(tf.reduce_any(tf.math.is_nan(values), axis=1), tf.reduce_any(tf.math.is_inf(values), axis=1))


@dataclasses.dataclass
class StepTrace:
    """What one train step of `owner` (a `NumericsHandle`) saw, collected while it runs or traces.

    Calls made in another graph than `graph` (a `tf.while_loop` body, shape inference) are
    not recorded. `entries` holds `(path, class name, compute dtype, row, term)` in call order
    (`term` a `terms.TermSource` or None); `gradients` `(grads, variables, scale, counts)`
    given to the optimizer, with `layers.scale_and_counts` read before the update.
    """

    graph: Any
    owner: Any = None
    entries: list = dataclasses.field(default_factory=list)
    gradients: list = dataclasses.field(default_factory=list)
    #: `backward.Boundary` of each checked layer call, in the order the calls began.
    boundaries: list = dataclasses.field(default_factory=list)
    #: Checked layer calls returned so far (their `Boundary.end`).
    ended: int = 0
    #: `id` of each loss term a checked layer's own `call` added (``add_loss``).
    added_in_call: set = dataclasses.field(default_factory=set)
    #: Whether the model's loss terms were recorded (the first read of its `losses`).
    terms_read: bool = False


def _last_true(flags: tf.Tensor) -> tf.Tensor:
    """Index (int64) of the last True in a 1-D bool tensor (0 when none)."""
    count = tf.shape(flags, out_type=tf.int64)[0]
    return count - 1 - tf.argmax(tf.cast(tf.reverse(flags, [0]), tf.int32), output_type=tf.int64)


def _kind_bits(nan: tf.Tensor, inf: tf.Tensor) -> tf.Tensor:
    """1 for NaN, 2 for inf, 3 for both (int64)."""
    return tf.cast(nan, tf.int64) + 2 * tf.cast(inf, tf.int64)


#: Scores of the replicas' failures, the lowest reported: forward ones their row index,
#: boundary ones `_BOUNDARY_SCORE` minus their call index, gradients `_BACKWARD_SCORE` minus
#: their variable index, none `_NO_FAILURE_SCORE`. All exact in float32 (below 2**24).
_NO_FAILURE_SCORE = 2.0**23
_BACKWARD_SCORE = 2.0**22
_BOUNDARY_SCORE = 2.0**21


class FailureRecorder:
    """Variables holding the first failure and the rows evaluated before it.

    Created eagerly and not tracked by the model (checkpoints are unchanged): `step`
    (int64, train steps since the hooks went in), `state` (int64 `[5]`: kind bits, step,
    phase code, index, non-finite gradients; kind 0 is no failure), `window` (float32
    `[trace_length, 6]`: the rows up to the failing one, oldest first, reaching into the
    previous step), `tail` (the previous step's last rows), `scale` (the loss scale at
    the failing step) and `boundary` (float32 `[3]`, see `OUT_GRAD`).

    Under a strategy each replica keeps its own copy (`replica_local_variable`), so
    `step` counts global steps; at a step's end the replicas exchange their candidate
    failures (one all-reduce) and all record the earliest in the step (`_agree`), so a
    failure is reported once, with that replica's rows; the host reads replica 0's copy.

    Args:
        trace_length: Int >= 1. Rows kept before a failure.
        strategy: `tf.distribute.Strategy` the model trains under.
    """

    def __init__(self, trace_length: int, strategy: tf.distribute.Strategy) -> None:
        self.trace_length = trace_length
        width = len(COLUMNS)
        with tf.init_scope(), strategy.scope():
            self.step = replica_local_variable(tf.constant(0, tf.int64), name="tfmp_numerics_step")
            self.state = replica_local_variable(tf.zeros([5], tf.int64), name="tfmp_numerics_state")
            self.window = replica_local_variable(tf.zeros([trace_length, width]), name="tfmp_numerics_window")
            self.tail = replica_local_variable(tf.zeros([trace_length, width]), name="tfmp_numerics_tail")
            self.scale = replica_local_variable(tf.constant(1.0), name="tfmp_numerics_scale")
            self.boundary = replica_local_variable(tf.zeros([3]), name="tfmp_numerics_boundary")
        #: `(path, class name, compute dtype, term)` of each row, from the latest trace.
        self.names: list[tuple[str, str, str, Any]] = []
        #: Variables given to the optimizer, from the latest trace of the step.
        self.variables: list[Any] = []
        #: `(path, class name, compute dtype, has trainable weights)` of each checked
        #: call's backward pass (`backward.Boundary`), in the order the calls began.
        self.boundary_names: list[tuple[str, str, str, bool]] = []
        #: `Boundary.end` of each checked call, in the same order.
        self.boundary_ends: list[int] = []

    def finish(self, trace: StepTrace) -> tf.Tensor:
        """Adds the ops that record `trace`'s first failure; call at the end of the step.

        On one replica the details are computed in a `tf.cond` branch that runs only on a
        failure; on several, every step, to agree on one (`_agree`). Returns the recorded kind
        bits (int64, 0: none), which the step returns so that the host need not read a variable.
        """
        self.names = [(path, layer_class, dtype, term) for path, layer_class, dtype, _, term in trace.entries]
        count = len(trace.entries)
        rows = tf.stack([entry[3] for entry in trace.entries]) if count else tf.zeros([0, len(COLUMNS)])
        history = tf.concat([self.tail.read_value(), rows], axis=0)
        bad_rows = tf.logical_not(tf.reduce_all(tf.math.is_finite(rows[:, ABS_MIN : IN_MAX + 1]), axis=1))
        maxima, counted, scale, counts = self._gradient_maxima(trace)
        bad_grads = tf.logical_and(tf.logical_not(tf.math.is_finite(maxima)), counted)
        bounds = self._boundary_maxima(trace, maxima)
        bad_bounds = tf.logical_and(tf.logical_not(tf.reduce_all(tf.math.is_finite(bounds), axis=1)), counts)
        found = tf.reduce_any(tf.stack([tf.reduce_any(bad_rows), tf.reduce_any(bad_grads), tf.reduce_any(bad_bounds)]))
        armed = tf.equal(self.state.read_value()[KIND], 0)
        details = lambda: self._details(rows, history, bad_rows, maxima, bad_grads, scale, bounds, counts)  # noqa: E731
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            tf.cond(tf.logical_and(armed, found), lambda: self._write(*details()), lambda: None)
        else:
            chosen = self._agree(found, *details())
            tf.cond(tf.logical_and(armed, chosen[0]), lambda: self._write(*chosen[1:]), lambda: None)
        self.tail.assign(history[count:])
        self.step.assign_add(1)
        return tf.identity(self.state.read_value()[KIND])

    def _details(self, rows: tf.Tensor, history: tf.Tensor, bad_rows: tf.Tensor, maxima: tf.Tensor,
                 bad_grads: tf.Tensor, scale: tf.Tensor, bounds: tf.Tensor, counts: tf.Tensor) -> tuple:
        """This step's first failure: a forward one; else a checked call's backward pass (`_boundary_failure`);
        else the non-finite gradient nearest the loss.

        Returns:
            (fields, window, scale, boundary): int64 `[4]` kind bits (0: no failure), phase
            code, index and non-finite gradient count; float32 `[trace_length, 6]` rows up to
            the failing one; the loss scale; float32 `[3]` (zeros unless at a boundary).
        """
        count = rows.shape[0]
        any_fwd = tf.reduce_any(bad_rows)
        zero = tf.constant(0, tf.int64)
        first = tf.argmax(tf.cast(bad_rows, tf.int32), output_type=tf.int64) if count else zero
        out_kind = row_kinds(rows, ABS_MIN, ABS_MAX + 1)
        fwd_kinds = tf.where(out_kind > 0, out_kind, row_kinds(rows, IN_MIN, IN_MAX + 1))
        grad_kinds = _kind_bits(tf.math.is_nan(maxima), tf.math.is_inf(maxima))
        last = _last_true(bad_grads) if maxima.shape[0] else zero
        pick = lambda kinds, index: tf.gather(tf.concat([kinds, [0]], 0), index)  # noqa: E731, empty-safe
        any_bound, bound_phase, bound_index, bound_kind, boundary = self._boundary_failure(bounds, counts)
        begin = tf.where(any_fwd, first + 1, count)
        backward = lambda at_bound, at_grad: tf.where(any_bound, at_bound, at_grad)  # noqa: E731
        fields = tf.stack(
            [
                tf.where(any_fwd, pick(fwd_kinds, first), backward(bound_kind, pick(grad_kinds, last))),
                tf.where(any_fwd, tf.constant(FORWARD, tf.int64),
                         backward(bound_phase, tf.constant(BACKWARD, tf.int64))),
                tf.where(any_fwd, first, backward(bound_index, last)),
                tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(maxima)), tf.int64)),
            ]
        )
        # A gather, not a slice: XLA takes a slice's begin as a compile-time constant, and this
        # one depends on the step's data: every step would compile again.
        window = tf.gather(history, begin + tf.range(self.trace_length, dtype=tf.int64))
        boundary = tf.where(tf.logical_and(any_bound, tf.logical_not(any_fwd)), boundary, tf.zeros([3]))
        return fields, window, scale, boundary

    def _boundary_failure(self, bounds: tf.Tensor, counts: tf.Tensor) -> tuple:
        """(found, phase, call index, kind bits, the call's `[3]` maxima) of the backward pass at boundaries.

        The latest call to begin whose output gradient was finite while its input or weight
        gradient was not (the innermost of nested ones), unless a call whose output gradient
        arrived non-finite returned after it (it met the bad gradient first: phase ABOVE).
        """
        size = bounds.shape[0]
        if not size:
            zero = tf.constant(0, tf.int64)
            return tf.constant(False), zero, zero, zero, tf.zeros([3])
        finite = tf.math.is_finite(bounds)
        out_bad = tf.logical_and(tf.logical_not(finite[:, OUT_GRAD]), counts)
        made = tf.logical_not(tf.logical_and(finite[:, IN_GRAD], finite[:, WEIGHT_GRAD]))
        culprit = tf.logical_and(tf.logical_and(finite[:, OUT_GRAD], made), counts)
        starts = tf.range(size, dtype=tf.int64)
        ends = tf.constant(self.boundary_ends, tf.int64)
        none = tf.constant(-1, tf.int64)
        made_at = tf.argmax(tf.where(culprit, starts, none), output_type=tf.int64)
        arrived_at = tf.argmax(tf.where(out_bad, ends, none), output_type=tf.int64)
        any_made, any_arrived = tf.reduce_any(culprit), tf.reduce_any(out_bad)
        use_made = tf.logical_and(
            any_made, tf.logical_or(tf.logical_not(any_arrived), tf.gather(ends, made_at) > tf.gather(ends, arrived_at))
        )
        index = tf.where(use_made, made_at, arrived_at)
        values = tf.gather(bounds, index)
        made_values = values[IN_GRAD:]
        kind = tf.where(
            use_made,
            _kind_bits(tf.reduce_any(tf.math.is_nan(made_values)), tf.reduce_any(tf.math.is_inf(made_values))),
            _kind_bits(tf.math.is_nan(values[OUT_GRAD]), tf.math.is_inf(values[OUT_GRAD])),
        )
        phase = tf.where(use_made, tf.constant(LAYER_BACKWARD, tf.int64), ABOVE)
        return tf.logical_or(any_made, any_arrived), phase, index, kind, values

    def _agree(self, found: tf.Tensor, fields: tf.Tensor, window: tf.Tensor, scale: tf.Tensor,
               boundary: tf.Tensor) -> tuple:
        """(found on any replica, then as `_details`) of the failure every replica records.

        One all-reduce of each replica's candidate packed as float32 `[found, kind, phase,
        index, bad gradients, scale, boundary (3), window...]`. The earliest in the step wins:
        forward before backward, the lowest row, then a layer's backward pass, the latest
        call first, then the gradient nearest the loss; ties go to the lowest replica.
        """
        width = len(COLUMNS)
        packed = tf.concat([[tf.cast(found, tf.float32)], tf.cast(fields, tf.float32), [scale], boundary,
                            tf.reshape(window, [-1])], axis=0)
        table = gather_replicas(packed)  # [replicas, 9 + trace_length * width]
        phase, index = table[:, 2], table[:, 3]
        at_boundary = tf.logical_or(tf.equal(phase, LAYER_BACKWARD), tf.equal(phase, ABOVE))
        score = tf.where(tf.equal(phase, FORWARD), index,
                         tf.where(at_boundary, _BOUNDARY_SCORE - index, _BACKWARD_SCORE - index))
        score = tf.where(table[:, 0] > 0, score, _NO_FAILURE_SCORE)
        replicas = tf.shape(table)[0]
        best = tf.equal(score, tf.reduce_min(score))
        chosen = table[tf.reduce_min(tf.where(best, tf.range(replicas), replicas))]
        window = tf.reshape(chosen[9:], [self.trace_length, width])
        return chosen[0] > 0, tf.cast(chosen[1:5], tf.int64), window, chosen[5], chosen[6:9]

    def _write(self, fields: tf.Tensor, window: tf.Tensor, scale: tf.Tensor, boundary: tf.Tensor) -> None:
        """Records a failure: `fields` as `_details` returns them, at the current step."""
        kind, phase, index, bad_grads = tf.unstack(fields)
        self.state.assign(tf.stack([kind, self.step.read_value(), phase, index, bad_grads]))
        self.window.assign(window)
        self.scale.assign(scale)
        self.boundary.assign(boundary)

    def _gradient_maxima(self, trace: StepTrace) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        """(max |gradient| per variable, float32 `[V]`; whether each counts, bool `[V]`; loss scale;
        whether the step's non-finite gradients count, True without an optimizer step seen)."""
        maxima, counted, variables = [], [], []
        scale, step_counts = tf.constant(1.0), tf.constant(True)
        for step_grads, step_vars, step_scale, counts in trace.gradients:
            scale, step_counts = step_scale, counts
            for grad, variable in zip(step_grads, step_vars):
                if grad is None:
                    continue
                maxima.append(max_magnitude(grad))
                counted.append(counts)
                variables.append(variable)
        self.variables = variables
        if not maxima:
            return tf.zeros([0]), tf.zeros([0], tf.bool), scale, step_counts
        return tf.stack(maxima), tf.stack(counted), scale, step_counts

    def _boundary_maxima(self, trace: StepTrace, maxima: tf.Tensor) -> tf.Tensor:
        """Float32 `[calls, 3]`: max |gradient| of each checked call's outputs, inputs and weights (0
        where none reached it). Call after `_gradient_maxima` (it reads `self.variables`)."""
        self.boundary_names = [(b.path, b.layer_class, b.dtype, bool(b.variables)) for b in trace.boundaries]
        self.boundary_ends = [b.end for b in trace.boundaries]
        if not trace.boundaries:
            return tf.zeros([0, 3])

        def largest(values: list) -> tf.Tensor:
            return nan_max(tf.stack(values)) if values else tf.constant(0.0)

        rows = []
        for bound in trace.boundaries:
            held = [i for i, variable in enumerate(self.variables) if id(variable) in bound.variables]
            weights = [tf.gather(maxima, held)] if held else []
            rows.append(tf.stack([largest(bound.out_grads), largest(bound.in_grads),
                                  nan_max(weights[0]) if weights else tf.constant(0.0)]))
        return tf.stack(rows)

    def failed(self) -> bool:
        """Bool. Whether a failure is recorded (one scalar read; the per-step fast path)."""
        return bool(self.state.numpy()[KIND])

    def rearm(self) -> None:
        """Clears the recorded failure so the next one is recorded (warn/log actions)."""
        self.state.assign(tf.zeros([5], tf.int64))
