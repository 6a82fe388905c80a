"""In-graph bookkeeping for `tfmp.check_numerics`: what a train step saw, and its first failure.

Why variables rather than an op that raises: `tf.debugging.check_numerics` stops the
graph with an `InvalidArgumentError` that names an op, not a layer, and reaches the
caller as a TensorFlow error rather than `tfmp.NonFiniteError`; `tf.py_function`
cannot be compiled by XLA. Instead, each hooked layer call is reduced to a row of six
float32 numbers (see `COLUMNS`), and at the end of the step the rows are stacked and
the first non-finite one, with the rows before it, is written into a few
`tf.Variable`s; the step also returns the failure flag (see `_numerics.py`).
Reductions, `tf.where` and variable writes all compile under XLA, and the checks add
no gradient: every checked tensor goes through `tf.stop_gradient` first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import keras
import tensorflow as tf

from tfmp._src.distribute import gather_replicas, replica_local_variable

#: Columns of one trace row (float32). VALID is 1 for a row that holds data; ABS_MIN
#: and ABS_MAX are the smallest and largest absolute output value; IN_MIN and IN_MAX
#: the signed range of the inputs; HAS_INPUT is 1 when the layer had numeric inputs.
#: TensorFlow's min/max reductions propagate NaN (its CPU and GPU kernels use
#: NaN-propagating reducers, and XLA's min/max do too), so a NaN or an infinity
#: anywhere in a tensor shows in its range: the row alone says whether the outputs,
#: or the inputs, were non-finite. A row counts as non-finite when either was: the
#: first layer to *see* a bad value is named even when it hides it (ReLU maps NaN to 0).
COLUMNS = ("valid", "abs_min", "abs_max", "in_min", "in_max", "has_input")
VALID, ABS_MIN, ABS_MAX, IN_MIN, IN_MAX, HAS_INPUT = range(len(COLUMNS))
#: Entries of the int64 `state` variable.
KIND, STEP, PHASE, INDEX, BAD_GRADS = range(5)
#: Phase codes kept in `state[PHASE]`: a layer output, a loss term or the loss
#: (FORWARD, `state[INDEX]` a trace row); the non-finite gradient nearest the loss
#: (BACKWARD, a variable); the layer whose backward pass turned a finite gradient
#: non-finite (LAYER_BACKWARD, a `backward.Boundary`); the checked layer call whose
#: output gradient came in non-finite from above it (ABOVE, a boundary).
FORWARD, BACKWARD, LAYER_BACKWARD, ABOVE = 1, 2, 3, 4
#: Entries of the `boundary` variable: max |gradient| of the named call's outputs,
#: of its inputs and of its trainable weights.
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
        pairs.append(tf.cast(tf.stack([tf.reduce_min(values), tf.reduce_max(values)]), tf.float32))
    if len(pairs) == 1:
        return pairs[0]
    stacked = tf.stack(pairs)
    return tf.stack([tf.reduce_min(stacked[:, 0]), tf.reduce_max(stacked[:, 1])])


def entry_row(outputs: Any, inputs: Any = None) -> Optional[tf.Tensor]:
    """Reduces one layer call (or the loss) to a trace row: about eight small ops.

    Args:
        outputs: Tensor or nested structure. The layer's outputs; non-float parts
            are ignored, and so are tensors known to be empty.
        inputs: Tensor, nested structure or None. The layer's first argument.

    Returns:
        Float32 tensor of shape `[len(COLUMNS)]`, or None when `outputs` holds no
        float tensor (nothing to check).
    """
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
    """What one train step saw, collected in Python while the step runs or traces.

    Attributes:
        graph: The graph the step builds in (the global graph when eager); layer
            calls made in any other graph (a `tf.while_loop` body, Keras's symbolic
            shape inference) are not recorded, their tensors could not leave it.
        owner: The `NumericsHandle` recording the step; hooks of other handles
            ignore it.
        entries: List of `(path, class name, compute dtype, row, term)`, in call
            order; `term` is None for a layer call or the loss, a `terms.TermSource`
            for a term of the model's losses.
        gradients: List of `(grads, variables, scale, counts)`: gradients given to the
            optimizer, the loss scale read before the update (scalar float32) and a
            scalar bool, True when a non-finite gradient is a real failure rather than
            an overflow the loss scale will back off from.
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


#: Score of a replica without a failure when picking the one to report; forward
#: failures score their row index, a layer's backward pass (or a gradient arriving
#: non-finite) `_BOUNDARY_SCORE` minus its call index, the gradient nearest the loss
#: `_BACKWARD_SCORE` minus its variable index. All are small integers, exact in
#: float32 (below 2**24).
_NO_FAILURE_SCORE = 2.0**23
_BACKWARD_SCORE = 2.0**22
_BOUNDARY_SCORE = 2.0**21


class FailureRecorder:
    """Variables holding the first failure and the rows evaluated before it.

    Variables (created eagerly, not tracked by the model, so checkpoints and saved
    models are unchanged): `step` (scalar int64, train steps since the hooks went
    in), `state` (int64 `[5]`: kind bits, step, phase code, index, number of
    non-finite gradients; kind 0 means no failure), `window` (float32
    `[trace_length, 6]`: the rows up to and including the failing one, oldest first,
    reaching back into the previous step when the failing layer comes early),
    `tail` (the last `trace_length` rows of the previous step), `scale` (float32,
    the loss scale at the failing step) and `boundary` (float32 `[3]`, for a
    failure named at a layer call's backward pass: max |gradient| of its outputs,
    inputs and weights).

    Under a `tf.distribute` strategy with several replicas (tested with
    `MirroredStrategy` on two logical CPUs, tests/test_distribute.py) every replica
    runs the step on its own shard, in a thread of its own. The
    variables are then created in the strategy's scope with one copy per replica
    (`distribute.replica_local_variable`): each replica counts its own steps and keeps its own
    `tail`, so `step` counts global steps, not replica steps. At the end of a step
    the replicas exchange their candidate failures (`gather_replicas`, one small
    all-reduce) and all record the same one: the failure earliest in the step (a
    forward failure before a backward one; among forward failures the lowest row
    index; then a layer call's backward pass, the latest call first; then the
    gradient nearest the loss; ties to the lowest replica). A failure seen on
    any replica is thus reported once, with that replica's rows, and the host
    reads replica 0's copy.

    Args:
        trace_length: Int >= 1. Rows kept before a failure.
        strategy: `tf.distribute.Strategy` the model trains under, or None for the
            current one.
    """

    def __init__(self, trace_length: int, strategy: Optional[tf.distribute.Strategy] = None) -> None:
        self.trace_length = trace_length
        width = len(COLUMNS)
        strategy = strategy if strategy is not None else tf.distribute.get_strategy()
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

        On one replica a healthy step pays for the detection only (a finiteness test
        of the stacked rows, of one max |gradient| per variable and of three
        numbers per checked layer call's backward pass) and the ring-buffer update;
        the failure details are computed in a `tf.cond` branch that runs on a
        failure. On several replicas each replica computes its candidate details
        every step and the replicas exchange them (see the class docstring), so
        that all agree on one failure.

        Returns:
            Scalar int64 tensor, the recorded kind bits after this step (0: no
            failure so far), the same on every replica. Returned by the step, it
            lets the host learn the outcome without running a variable read of its
            own.
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

    def _details(
        self,
        rows: tf.Tensor,
        history: tf.Tensor,
        bad_rows: tf.Tensor,
        maxima: tf.Tensor,
        bad_grads: tf.Tensor,
        scale: tf.Tensor,
        bounds: tf.Tensor,
        counts: tf.Tensor,
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        """This step's first failure, as `finish` records it.

        A forward failure comes first; then a checked layer call's backward pass:
        the call whose output gradient was finite while its input or weight
        gradient was not (the latest such call to begin, so the innermost of
        nested ones), unless a call whose output gradient arrived non-finite
        returned after it (it met the bad gradient first; phase ABOVE); then the
        non-finite gradient nearest the loss.

        Returns:
            (fields, window, scale, boundary): int64 `[4]` kind bits, phase code,
            index and number of non-finite gradients (all 0 kind when the step had
            no failure); float32 `[trace_length, 6]` rows up to the failing one;
            the loss scale (scalar float32); float32 `[3]` the named call's
            max |gradient| of outputs, inputs and weights (zeros for another phase).
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
        window = tf.slice(history, tf.stack([begin, 0]), [self.trace_length, len(COLUMNS)])
        boundary = tf.where(tf.logical_and(any_bound, tf.logical_not(any_fwd)), boundary, tf.zeros([3]))
        return fields, window, scale, boundary

    def _boundary_failure(self, bounds: tf.Tensor, counts: tf.Tensor) -> tuple:
        """(found, phase, call index, kind bits, the call's `[3]` maxima) of the backward pass at boundaries."""
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

    def _agree(
        self, found: tf.Tensor, fields: tf.Tensor, window: tf.Tensor, scale: tf.Tensor, boundary: tf.Tensor
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        """The failure every replica records, from each replica's own `_details`.

        One all-reduce (`gather_replicas`) of each replica's candidate packed as
        float32 `[found, kind, phase, index, bad gradients, scale, boundary (3),
        window...]`: the small integers are exact in float32 and non-finite
        values arrive unchanged. The earliest failure in the step wins (see the
        class docstring); ties go to the lowest replica.

        Returns:
            (found, fields, window, scale, boundary) of the chosen replica, the
            same on every replica: scalar bool, True when any replica failed;
            then as `_details`.
        """
        width = len(COLUMNS)
        packed = tf.concat(
            [[tf.cast(found, tf.float32)], tf.cast(fields, tf.float32), [scale], boundary, tf.reshape(window, [-1])],
            axis=0,
        )
        table = gather_replicas(packed)  # [replicas, 9 + trace_length * width]
        phase, index = table[:, 2], table[:, 3]
        at_boundary = tf.logical_or(tf.equal(phase, LAYER_BACKWARD), tf.equal(phase, ABOVE))
        score = tf.where(tf.equal(phase, FORWARD), index,
                         tf.where(at_boundary, _BOUNDARY_SCORE - index, _BACKWARD_SCORE - index))
        score = tf.where(table[:, 0] > 0, score, _NO_FAILURE_SCORE)
        replicas = tf.shape(table)[0]
        best = tf.equal(score, tf.reduce_min(score))
        chosen = table[tf.reduce_min(tf.where(best, tf.range(replicas), replicas))]
        return (
            chosen[0] > 0,
            tf.cast(chosen[1:5], tf.int64),
            tf.reshape(chosen[9:], [self.trace_length, width]),
            chosen[5],
            chosen[6:9],
        )

    def _write(self, fields: tf.Tensor, window: tf.Tensor, scale: tf.Tensor, boundary: tf.Tensor) -> None:
        """Records a failure: `fields` as `_details` returns them, at the current step."""
        kind, phase, index, bad_grads = tf.unstack(fields)
        self.state.assign(tf.stack([kind, self.step.read_value(), phase, index, bad_grads]))
        self.window.assign(window)
        self.scale.assign(scale)
        self.boundary.assign(boundary)

    def _gradient_maxima(self, trace: StepTrace) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        """(max |gradient| per variable, float32 `[V]`; whether each counts, bool `[V]`; loss scale;
        whether a non-finite gradient of the step counts, scalar bool: True without an optimizer step seen)."""
        maxima, counted, variables = [], [], []
        scale, step_counts = tf.constant(1.0), tf.constant(True)
        for step_grads, step_vars, step_scale, counts in trace.gradients:
            scale, step_counts = step_scale, counts
            for grad, variable in zip(step_grads, step_vars):
                if grad is None:
                    continue
                if isinstance(grad, tf.IndexedSlices):
                    grad = grad.values
                maxima.append(tf.cast(tf.reduce_max(tf.abs(tf.stop_gradient(grad))), tf.float32))
                counted.append(counts)
                variables.append(variable)
        self.variables = variables
        if not maxima:
            return tf.zeros([0]), tf.zeros([0], tf.bool), scale, step_counts
        return tf.stack(maxima), tf.stack(counted), scale, step_counts

    def _boundary_maxima(self, trace: StepTrace, maxima: tf.Tensor) -> tf.Tensor:
        """Float32 `[calls, 3]`: max |gradient| of each checked call's outputs, inputs and weights.

        A call no gradient reached (nothing noted) counts 0, finite. Call after
        `_gradient_maxima` (it reads `self.variables`).
        """
        self.boundary_names = [(b.path, b.layer_class, b.dtype, bool(b.variables)) for b in trace.boundaries]
        self.boundary_ends = [b.end for b in trace.boundaries]
        if not trace.boundaries:
            return tf.zeros([0, 3])

        def largest(values: list) -> tf.Tensor:
            return tf.reduce_max(tf.stack(values)) if values else tf.constant(0.0)

        rows = []
        for bound in trace.boundaries:
            held = [i for i, variable in enumerate(self.variables) if id(variable) in bound.variables]
            weights = [tf.gather(maxima, held)] if held else []
            rows.append(tf.stack([largest(bound.out_grads), largest(bound.in_grads),
                                  tf.reduce_max(weights[0]) if weights else tf.constant(0.0)]))
        return tf.stack(rows)

    def failed(self) -> bool:
        """Bool. Whether a failure is recorded (one scalar read; the per-step fast path)."""
        return bool(self.state.numpy()[KIND])

    def read_state(self) -> list[int]:
        """The int64 `state` as Python ints (host read, between steps)."""
        return [int(v) for v in self.state.numpy()]

    def rearm(self) -> None:
        """Clears the recorded failure so the next one is recorded (warn/log actions)."""
        self.state.assign(tf.zeros([5], tf.int64))
