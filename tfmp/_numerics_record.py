"""In-graph bookkeeping for `tfmp.check_numerics`: what a train step saw, and its first failure.

Why variables rather than an op that raises: `tf.debugging.check_numerics` stops the
graph with an `InvalidArgumentError` that names an op, not a layer, and reaches the
caller as a TensorFlow error rather than `tfmp.NonFiniteError`; `tf.py_function`
cannot be compiled by XLA. Instead, each hooked tensor is reduced to a row of eight
float32 numbers (see `COLUMNS`), and at the end of the step the rows are stacked and
the first non-finite one, with the rows before it, is written into a few
`tf.Variable`s. The host reads one int64 vector after the step (see `_numerics.py`).
Reductions, `tf.where` and variable writes all compile under XLA, and the checks add
no gradient: every checked tensor goes through `tf.stop_gradient` first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import keras
import tensorflow as tf

#: Columns of one trace row (float32). VALID is 1 for a row that holds data; NAN and
#: INF are 1 when the output holds a NaN / an infinity; ABS_MIN and ABS_MAX are the
#: smallest and largest absolute output value; IN_MIN and IN_MAX the signed range of
#: the inputs, IN_NAN and IN_INF 1 when they hold a NaN / an infinity; HAS_INPUT is 1
#: when the layer had numeric inputs. A row is non-finite when its outputs or its
#: inputs are: the first layer to *see* a bad value is named even when it hides it
#: (ReLU turns NaN into 0).
COLUMNS = ("valid", "nan", "inf", "abs_min", "abs_max", "in_min", "in_max", "in_nan", "in_inf", "has_input")
VALID, NAN, INF, ABS_MIN, ABS_MAX, IN_MIN, IN_MAX, IN_NAN, IN_INF, HAS_INPUT = range(len(COLUMNS))
#: Entries of the int64 `state` variable.
KIND, STEP, PHASE, INDEX, BAD_GRADS = range(5)
#: Phase codes kept in `state[PHASE]`: a layer output or the loss, or a gradient.
FORWARD, BACKWARD = 1, 2
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
        if dtype.is_floating or (integers and dtype.is_integer):
            found.append(tf.stop_gradient(value))
    return found


def _combine(reduce: Any, tensors: list[tf.Tensor], combine: Any) -> tf.Tensor:
    """Applies `reduce` to each tensor, casts to float32 and folds with `combine`."""
    values = [tf.cast(reduce(t), tf.float32) for t in tensors]
    return values[0] if len(values) == 1 else combine(tf.stack(values))


def _flags(tensors: list[tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
    """(any NaN, any infinity) over `tensors`, as float32 scalars 0 or 1."""
    nan = _combine(lambda t: tf.reduce_any(tf.math.is_nan(t)), tensors, tf.reduce_max)
    inf = _combine(lambda t: tf.reduce_any(tf.math.is_inf(t)), tensors, tf.reduce_max)
    return nan, inf


def entry_row(outputs: Any, inputs: Any = None) -> Optional[tf.Tensor]:
    """Reduces one layer call (or the loss) to a trace row.

    Args:
        outputs: Tensor or nested structure. The layer's outputs; non-float parts
            are ignored.
        inputs: Tensor, nested structure or None. The layer's first argument.

    Returns:
        Float32 tensor of shape `[len(COLUMNS)]`, or None when `outputs` holds no
        float tensor (nothing to check).
    """
    outs = _tensors(outputs, integers=False)
    if not outs:
        return None
    magnitudes = [tf.abs(t) for t in outs]
    nan, inf = _flags(outs)
    abs_min = _combine(tf.reduce_min, magnitudes, tf.reduce_min)
    abs_max = _combine(tf.reduce_max, magnitudes, tf.reduce_max)
    ins = _tensors(inputs, integers=True)
    if ins:
        in_min = _combine(tf.reduce_min, ins, tf.reduce_min)
        in_max = _combine(tf.reduce_max, ins, tf.reduce_max)
        floats = [t for t in ins if t.dtype.is_floating]
        in_nan, in_inf = _flags(floats) if floats else (tf.constant(0.0), tf.constant(0.0))
        has_input = tf.constant(1.0)
    else:
        in_min = in_max = in_nan = in_inf = has_input = tf.constant(0.0)
    return tf.stack([tf.constant(1.0), nan, inf, abs_min, abs_max, in_min, in_max, in_nan, in_inf, has_input])


@dataclasses.dataclass
class StepTrace:
    """What one train step saw, collected in Python while the step runs or traces.

    Attributes:
        graph: The graph the step builds in (the global graph when eager); layer
            calls made in any other graph (a `tf.while_loop` body, Keras's symbolic
            shape inference) are not recorded, their tensors could not leave it.
        owner: The `NumericsHandle` recording the step; hooks of other handles
            ignore it.
        entries: List of `(path, class name, compute dtype, row)`, in call order.
        gradients: List of `(grads, variables, scale, counts)`: gradients given to the
            optimizer, the loss scale read before the update (scalar float32) and a
            scalar bool, True when a non-finite gradient is a real failure rather than
            an overflow the loss scale will back off from.
    """

    graph: Any
    owner: Any = None
    entries: list = dataclasses.field(default_factory=list)
    gradients: list = dataclasses.field(default_factory=list)


def _last_true(flags: tf.Tensor) -> tf.Tensor:
    """Index (int64) of the last True in a 1-D bool tensor (0 when none)."""
    count = tf.shape(flags, out_type=tf.int64)[0]
    return count - 1 - tf.argmax(tf.cast(tf.reverse(flags, [0]), tf.int32), output_type=tf.int64)


def _kind_bits(nan: tf.Tensor, inf: tf.Tensor) -> tf.Tensor:
    """1 for NaN, 2 for inf, 3 for both (int64)."""
    return tf.cast(nan, tf.int64) + 2 * tf.cast(inf, tf.int64)


class FailureRecorder:
    """Variables holding the first failure and the rows evaluated before it.

    Variables (created eagerly, not tracked by the model, so checkpoints and saved
    models are unchanged): `step` (scalar int64, train steps since the hooks went
    in), `state` (int64 `[5]`: kind bits, step, phase code, index, number of
    non-finite gradients; kind 0 means no failure), `window` (float32
    `[trace_length, 8]`: the rows up to and including the failing one, oldest first,
    reaching back into the previous step when the failing layer comes early),
    `tail` (the last `trace_length` rows of the previous step) and `scale` (float32,
    the loss scale at the failing step).

    Args:
        trace_length: Int >= 1. Rows kept before a failure.
    """

    def __init__(self, trace_length: int) -> None:
        self.trace_length = trace_length
        width = len(COLUMNS)
        with tf.init_scope():
            self.step = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="tfmp_numerics_step")
            self.state = tf.Variable(tf.zeros([5], tf.int64), trainable=False, name="tfmp_numerics_state")
            self.window = tf.Variable(tf.zeros([trace_length, width]), trainable=False, name="tfmp_numerics_window")
            self.tail = tf.Variable(tf.zeros([trace_length, width]), trainable=False, name="tfmp_numerics_tail")
            self.scale = tf.Variable(1.0, trainable=False, name="tfmp_numerics_scale")
        #: `(path, class name, compute dtype)` of each row, from the latest trace.
        self.names: list[tuple[str, str, str]] = []
        #: Variables given to the optimizer, from the latest trace of the step.
        self.variables: list[Any] = []

    def finish(self, trace: StepTrace) -> None:
        """Adds the ops that record `trace`'s first failure; call at the end of the step."""
        self.names = [entry[:3] for entry in trace.entries]
        width = len(COLUMNS)
        rows = tf.stack([entry[3] for entry in trace.entries]) if trace.entries else tf.zeros([0, width])
        count = len(trace.entries)
        fwd_kind = _kind_bits(rows[:, NAN] + rows[:, IN_NAN] > 0, rows[:, INF] + rows[:, IN_INF] > 0)
        fwd_bad = fwd_kind > 0
        any_fwd = tf.reduce_any(fwd_bad)
        first = tf.argmax(tf.cast(fwd_bad, tf.int32), output_type=tf.int64) if count else tf.constant(0, tf.int64)
        history = tf.concat([self.tail, rows], axis=0)

        any_bwd, last, bwd_kind, bad_grads, scale = self._gradients(trace)
        fwd_pick = tf.gather(fwd_kind, first) if count else tf.constant(0, tf.int64)
        kind = tf.where(any_fwd, fwd_pick, bwd_kind)
        begin = tf.where(any_fwd, first + 1, tf.constant(count, tf.int64))
        window = tf.slice(history, tf.stack([begin, tf.constant(0, tf.int64)]), [self.trace_length, width])
        state = tf.stack(
            [kind, self.step.read_value(), tf.where(any_fwd, tf.constant(FORWARD, tf.int64), BACKWARD),
             tf.where(any_fwd, first, last), bad_grads]
        )
        new = tf.logical_and(tf.equal(self.state[KIND], 0), kind > 0)
        self.state.assign(tf.where(new, state, self.state))
        self.window.assign(tf.where(new, window, self.window))
        self.scale.assign(tf.where(new, scale, self.scale))
        self.tail.assign(history[count:])
        self.step.assign_add(1)

    def _gradients(self, trace: StepTrace) -> tuple:
        """(any counted, index of the last counted, its kind, count, loss scale)."""
        grads, variables, counted, nans, infs = [], [], [], [], []
        scale = tf.constant(1.0)
        for step_grads, step_vars, step_scale, counts in trace.gradients:
            scale = step_scale
            for grad, variable in zip(step_grads, step_vars):
                if grad is None:
                    continue
                if isinstance(grad, tf.IndexedSlices):
                    grad = grad.values
                grad = tf.stop_gradient(grad)
                nans.append(tf.reduce_any(tf.math.is_nan(grad)))
                infs.append(tf.reduce_any(tf.math.is_inf(grad)))
                counted.append(counts)
                variables.append(variable)
                grads.append(grad)
        self.variables = variables
        if not grads:
            zero = tf.constant(0, tf.int64)
            return tf.constant(False), zero, zero, zero, scale
        kinds = _kind_bits(tf.stack(nans), tf.stack(infs))
        bad = tf.logical_and(kinds > 0, tf.stack(counted))
        last = _last_true(bad)
        bad_count = tf.reduce_sum(tf.cast(kinds > 0, tf.int64))
        return tf.reduce_any(bad), last, tf.where(tf.reduce_any(bad), tf.gather(kinds, last), 0), bad_count, scale

    def read_state(self) -> list[int]:
        """The int64 `state` as Python ints (host read, between steps)."""
        return [int(v) for v in self.state.numpy()]

    def rearm(self) -> None:
        """Clears the recorded failure so the next one is recorded (warn/log actions)."""
        self.state.assign(tf.zeros([5], tf.int64))
