"""Loss scaling that never fails silently: `tfmp.LossScaleOptimizer`.

Keras's `LossScaleOptimizer` halves the scale without a floor, doubles it without a ceiling
and counts nothing. The subclass keeps its `apply` and state and adds scale bounds,
hysteresis, counters saved as optimizer variables, the step's guard (`guard`) and stuck
detection (`loops`).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, NamedTuple

import keras
import tensorflow as tf
from keras import ops

from tfmp._src import distribute as _distribute
from tfmp._src.errors import invalid_argument
from tfmp._src.float32.master_weights import MasterCopies, float32_gradients
from tfmp._src.keras_hooks.optimizer_steps import (
    LossScaleOptimizerBase,
    no_automatic_dependency_tracking,
    optimizer_variables,
    overwrites_with_gradient,
)
from tfmp._src.loss_scale import arguments as _arguments
from tfmp._src.loss_scale import guard as _guard
from tfmp._src.loss_scale import loops as _loops
from tfmp._src.loss_scale import saved_form as _saved_form
from tfmp._src.float32 import step_state as _step_state
from tfmp._src.loss_scale import user_settings as _user_settings
from tfmp._src.policy.fused_update import fused_updates
from tfmp._src.policy import speedups

_INT = "int64"
_COUNTERS = ("overflow_count", "consecutive_overflows", "last_overflow_step", "total_steps",
             "min_scale_overflows", "last_loss_status", "last_overflow_status")
#: Names of the scalar state variables: Keras's two, then tfmp's.
STATE_VARIABLES = ("dynamic_scale", "step_counter") + _COUNTERS
#: Base optimizer settings the wrapper forwards to the inner optimizer (Keras's forwards only `learning_rate`).
FORWARDED_SETTINGS = ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "use_ema", "ema_momentum",
                      "ema_overwrite_frequency", "gradient_accumulation_steps")
#: Bits of `last_loss_status`: what the last step found non-finite.
STATUS_BITS = {"loss nan": 1, "loss inf": 2, "batch nan": 4, "batch inf": 8, "values": 16, "scale": 32}
_LOSS_BITS = 1 | 2
_HISTORIES = ("overflow_history_steps", "overflow_history_scales")

#: Length of the overflow history ring buffers: the skipped steps a reader between steps can itemize.
OVERFLOW_HISTORY = 64


def _sound_scale(scale: Any) -> Any:
    """Scalar bool tensor: `scale` is finite and > 0 (anything else: restored or assigned, never trained to)."""
    return ops.logical_and(ops.isfinite(scale), ops.greater(scale, 0.0))


def all_finite(grads: list) -> Any:
    """Scalar bool tensor: every value of every gradient in `grads` (tensors, ``tf.IndexedSlices`` or None) is finite.

    As Keras's ``LossScaleOptimizer.check_finite``, except that a sparse gradient (an embedding's
    ``tf.IndexedSlices``) is checked on its values: Keras's ``ops.isfinite`` first writes it out as a
    dense boolean tensor of the whole table's shape (``tf.fill`` and ``tf.tensor_scatter_nd_update``),
    every step.
    """
    checks = [ops.all(ops.isfinite(g.values if isinstance(g, tf.IndexedSlices) else g))
              for g in grads if g is not None]
    return ops.all(ops.convert_to_tensor(checks))


class _Applying(NamedTuple):
    """The `apply` under way: its loss check (``""``: the gradients'), the ``"values"`` guard,
    ids of gradients not to divide again, statistics a skipped step puts back."""

    check_loss: str = ""
    check_values: bool = False
    unscaled: frozenset = frozenset()
    statistics: tuple = ()


def _forwarded(name: str) -> property:
    """`name` on the inner optimizer; the wrapper's own before it exists and while the wrapper builds."""

    def read(self: Any) -> Any:
        inner = vars(self).get("inner_optimizer")
        if inner is None or vars(self).get("_tfmp_building"):
            return vars(self).get("_tfmp_own_settings", {}).get(name)
        return getattr(inner, name)

    def write(self: Any, value: Any) -> None:
        inner = vars(self).get("inner_optimizer")
        if inner is None:
            vars(self).setdefault("_tfmp_own_settings", {})[name] = value
        else:
            setattr(inner, name, value)

    return property(read, write, doc=f"The inner optimizer's `{name}` (read and written there).")


@keras.saving.register_keras_serializable(package="tfmp")
class LossScaleOptimizer(LossScaleOptimizerBase):
    """Keras's `LossScaleOptimizer` with counters, bounds and stuck detection.

    A finite step divides the gradients by the scale and hands them to `inner_optimizer`;
    after `dynamic_growth_steps` finite steps in a row the scale doubles, up to `max_scale`.
    A non-finite step (per `guard`) is skipped and counted; after `hysteresis` in a row the
    scale halves, never below `min_scale`. A skipped step does not advance the inner
    `iterations` (nor learning-rate schedules); `total_steps` counts every step.

    Optimizer variables (scalars made in `build`, saved): `dynamic_scale` (float32),
    `step_counter` (finite steps since the last scale change), and int64 `overflow_count`,
    `consecutive_overflows`, `last_overflow_step` (zero-based, -1 if none), `total_steps`,
    `min_scale_overflows` (skips in a row at `min_scale`), `last_loss_status` (the last
    step's `STATUS_BITS` on any replica: 1 NaN, 2 inf in the loss given to `scale_loss`; 4
    NaN, 8 inf in the train step's batch; 16 a non-finite value the ``"values"`` guard
    caught; 32 a loss scale not finite and > 0, which no run reaches: that step is skipped
    and the scale set to `min_scale`) and `last_overflow_status` (those bits at the last
    skip). Ring buffers indexed by `overflow_count % OVERFLOW_HISTORY` (64):
    `overflow_history_steps` (int64, -1 if none), `overflow_history_scales` (float32,
    (64, 2): scale before and after).

    Stuck: after `max_consecutive_overflows` skips in a row, or `MIN_SCALE_PATIENCE` (3)
    at `min_scale`, `raise_if_stuck` raises `tfmp.NonFiniteError` (or warns,
    `on_stuck="warn"`), after every eager `apply` and every `model.fit` step.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer` to wrap; its clipping, weight decay
            and gradient accumulation see unscaled gradients.
        initial_scale: Float in [`min_scale`, `max_scale`]. Default 2**15 (Keras).
        dynamic_growth_steps: Int >= 1. Finite steps in a row before the scale doubles.
        min_scale: Float > 0. Default 1.0.
        max_scale: Float. Default 2**24 (apex).
        hysteresis: Int >= 1. Non-finite steps in a row before the first halving
            (DeepSpeed's option); 1 is Keras's behaviour.
        max_consecutive_overflows: Int >= 1. Skips in a row that count as stuck. Default 32.
        on_stuck: String, `"raise"` (default) or `"warn"` (once per stuck run).
        loss_scaling: Bool. False fixes the scale at 1.0 (bfloat16, float32); non-finite
            steps are still skipped and counted.
        guard: String, what a step is checked for (costs in `benchmarks/guard_cost.py`):
            `"batch"` or `"loss"` (only with `loss_scaling=False`), `"gradients"`,
            `"values"` (not under a tf.distribute strategy) or `"auto"` (default:
            `"gradients"` with loss scaling, `"batch"` without). A step applied without
            `scale_loss` gets the gradients check.
        name: String or None.
        **kwargs: Keras's backwards-compatibility arguments (`dynamic=True` and the base
            optimizer's defaults); anything else raises ValueError.

    Master copies: a 16-bit trainable variable among float32 ones (a mixed model's, e.g.
    ``add_weight(dtype=self.compute_dtype)``) gets a float32 copy at `build` (`master_copies`):
    the inner optimizer updates the copy (its slots float32, so Adam's bias correction is right)
    and the variable, still 16-bit, is assigned the rounded copy after each applied step. The
    copies are not saved (the file keeps Keras's layout); a variable changed elsewhere (a
    loaded file, `set_weights`) gives its value back to its copy at the next step.

    `fused_updates` (bool attribute, not saved, read when a step is traced): run an inner
    Adam's or SGD's update on TensorFlow's fused kernel. Default: True where no GPU or TPU
    runs the steps, unless made under ``tfmp.enable(speedups=False)`` or ``{"fused_update": False}``.

    The inner optimizer's settings (`FORWARDED_SETTINGS`, `learning_rate`, public
    attributes such as Adam's `beta_1`) and `exclude_from_weight_decay` are reached
    through the wrapper. Setting `loss_scale_factor` on the wrapper raises.

    Raises:
        ValueError: (template, naming the argument) a value outside what Args gives, an
            unknown keyword argument, or an `inner_optimizer` that is itself a loss-scale
            optimizer (a kept reference would train with a second scale).

    Example:
        >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10)
        >>> opt.loss_scale
        1024.0
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        initial_scale: float = _loops.DEFAULT_INITIAL_SCALE,
        dynamic_growth_steps: int = 2000,
        *,
        min_scale: float = _arguments.DEFAULT_MIN_SCALE,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        max_consecutive_overflows: int = _loops.DEFAULT_MAX_CONSECUTIVE_OVERFLOWS,
        on_stuck: str = "raise",
        loss_scaling: bool = True,
        guard: str = "auto",
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        settings = dict(min_scale=min_scale, max_scale=max_scale, hysteresis=hysteresis, on_stuck=on_stuck,
                        max_consecutive_overflows=max_consecutive_overflows, loss_scaling=loss_scaling,
                        guard=guard)
        _arguments.check_arguments(inner_optimizer, initial_scale, dynamic_growth_steps, name=name,
                                   kwargs=kwargs, **settings)
        # Keras's build and scale_loss read `initial_scale`: 1.0 without loss scaling.
        super().__init__(inner_optimizer, float(initial_scale) if loss_scaling else 1.0, dynamic_growth_steps,
                         name=name, **kwargs)
        self._config_initial_scale = initial_scale
        settings.update(min_scale=float(min_scale), max_scale=float(max_scale))
        for key, value in settings.items():
            setattr(self, key, value)
        self.fused_updates = speedups.on_now("fused_update")
        self._watch = _loops.Watch()
        self._steps = _guard.StepRecord()
        self._origins = _guard.GradientOrigins()
        # Past Keras's tracking, which would track the statistics as optimizer variables.
        object.__setattr__(self, "_applying", _Applying())
        _loops.track(self)

    def __repr__(self) -> str:
        """E.g. ``tfmp.LossScaleOptimizer(Adam, name='lso'): dynamic loss scale 32768, guard='auto'``."""
        scaling = "no loss scaling"
        if self.loss_scaling:
            scaling = "dynamic loss scale"
            if not self.built or tf.executing_eagerly():  # a variable is not read while a step is traced
                try:
                    scaling += f" {self.loss_scale:g}"
                except (TypeError, ValueError):  # left unset by a first step that failed while traced
                    pass
        return (f"tfmp.LossScaleOptimizer({type(self.inner_optimizer).__name__}, name={self.name!r}): "
                f"{scaling}, guard={self.guard!r}")

    def __getattr__(self, name: str) -> Any:
        # Public settings of the inner optimizer (e.g. Adam's beta_1).
        inner = vars(self).get("inner_optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = vars(self).get("inner_optimizer")
        if name == "loss_scale_factor" and inner is not None and value is not None:
            raise invalid_argument(
                "loss_scale_factor", value, "None on a tfmp.LossScaleOptimizer (it scales the loss itself)",
                fix="Set `initial_scale` (and min_scale/max_scale) instead, or use the inner optimizer "
                "without the wrapper for a fixed loss_scale_factor.",
            )
        if (inner is not None and not name.startswith("_") and name not in vars(self)
                and not hasattr(type(self), name) and not hasattr(type(inner), name) and name in vars(inner)):
            setattr(inner, name, value)  # e.g. Adam's beta_1
            return
        super().__setattr__(name, value)

    def exclude_from_weight_decay(self, var_list: Any = None, var_names: Any = None) -> None:
        """Excludes variables from the inner optimizer's weight decay (Keras's method)."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    @no_automatic_dependency_tracking
    def build(self, var_list: list) -> None:
        """Creates Keras's variables, then tfmp's counters (see the class docstring)."""
        object.__setattr__(self, "_tfmp_building", True)
        try:
            masters = MasterCopies(var_list)
            object.__setattr__(self, "_master_copies", masters)  # past Keras's tracking: not saved
            if masters:  # the inner optimizer's slots on the float32 copies (Keras's build then finds it built)
                self.inner_optimizer.build(masters.substitute(var_list))
            super().build(var_list)
        finally:
            object.__setattr__(self, "_tfmp_building", False)
        for name in _COUNTERS:
            start = keras.initializers.Constant(-1 if name == "last_overflow_step" else 0)
            setattr(self, name, self.add_variable((), start, _INT, name=name))
        self.overflow_history_steps = self.add_variable(
            (OVERFLOW_HISTORY,), keras.initializers.Constant(-1), _INT, name="overflow_history_steps")
        self.overflow_history_scales = self.add_variable(
            (OVERFLOW_HISTORY, 2), "zeros", "float32", name="overflow_history_scales")

    @property
    def master_copies(self) -> MasterCopies:
        """`master_weights.MasterCopies`: float32 copies of the 16-bit trainable variables of a mixed model
        (none before `build`, nor for a model without such variables)."""
        return vars(self).get("_master_copies") or MasterCopies([])

    @property
    def loss_scale(self) -> float:
        """Float. The current loss scale (the initial one before `build`)."""
        return float(self.dynamic_scale.numpy() if self.built else self.initial_scale)

    def record_batch(self, data: Any) -> None:
        """Records whether the float tensors of the train step's batch `data` are finite.

        Called by tfmp as ``train_step(data)`` starts; `scale_loss` stores it in `last_loss_status` (bits 4, 8).
        """
        leaves = [leaf for leaf in tf.nest.flatten(data) if isinstance(leaf, tf.Tensor) and leaf.dtype.is_floating]
        if leaves:
            nan = tf.reduce_any([tf.reduce_any(tf.math.is_nan(leaf)) for leaf in leaves])
            inf = tf.reduce_any([tf.reduce_any(tf.math.is_inf(leaf)) for leaf in leaves])
            self._steps.note_batch((nan, inf))

    def _record_status(self, loss: Any = None) -> None:
        """Stores the loss's (if given), this step's batch's non-finite bits and an impossible scale's in
        `last_loss_status`."""
        batch = self._steps.take_batch_status()
        if not self.built or (loss is None and batch is None and not self.loss_scaling):
            return
        flags = {}
        if loss is not None:
            value = ops.convert_to_tensor(loss)
            flags = {"loss nan": ops.any(ops.isnan(value)), "loss inf": ops.any(ops.isinf(value))}
        if self.loss_scaling:  # e.g. 0 restored from a checkpoint: its step would write 0/0
            flags["scale"] = ops.logical_not(_sound_scale(self.dynamic_scale))
        if batch is not None:
            flags.update(zip(("batch nan", "batch inf"), batch))
        found = _distribute.any_replica(list(flags.values()))  # on any replica
        self.last_loss_status.assign(sum(ops.cast(flag, _INT) * STATUS_BITS[name] for name, flag in zip(flags, found)))

    def scale_loss(self, loss: Any) -> Any:
        """Multiplies `loss` by the scale, recording whether the loss (and the batch) is finite.

        The record tells a non-finite loss from gradient overflow (stuck detection, guards).
        """
        self._steps.note_scale_loss(self.built)
        self._record_status(loss)
        if not self.loss_scaling:
            return loss  # the scale is fixed at 1.0
        return super().scale_loss(loss)

    def check_finite(self, grads: list) -> Any:
        """Scalar bool tensor: True when the step passes its guard on every replica.

        The gradients on all replicas in sync (Keras keeps replica 0's answer); under the
        ``"loss"`` guard the loss `scale_loss` recorded instead; under ``"batch"`` both. With loss
        scaling, False too when the scale is not finite and > 0.
        """
        check_loss = self._applying.check_loss
        if not check_loss:
            finite = self._gradients_finite(grads)
        else:
            loss_finite = ops.equal(tf.bitwise.bitwise_and(self.last_loss_status.value, _LOSS_BITS), 0)
            finite = loss_finite if check_loss == "loss" else ops.logical_and(
                loss_finite, self._gradients_finite(grads))
        if not self.loss_scaling:
            return finite
        scale_sound = ops.equal(tf.bitwise.bitwise_and(self.last_loss_status.value, STATUS_BITS["scale"]), 0)
        return ops.logical_and(finite, scale_sound)

    def _gradients_finite(self, grads: list) -> Any:
        return _distribute.all_replicas_finite(all_finite(grads))

    def get_scaled_loss(self, loss: Any) -> Any:
        """Alias of `scale_loss`, under its tf.keras 2 name."""
        return self.scale_loss(loss)

    def _note_handed_out(self, grads: list) -> None:
        """`tfmp.scaled_gradients`' result, so an eager `apply` tells a clip of it (`guard.cut_while_scaled`)."""
        if self.loss_scaling:
            self._steps.note_handed_out(grads)

    def get_unscaled_gradients(self, grads: list) -> list:
        """Divides `grads` (list of tensors or None) by the scale, as tf.keras 2 did.

        `apply` in the same step (traced, or the next eager `apply`) does not divide them
        again, also after ops on them (clipping, a cast).

        Returns:
            List of tensors (float32 where given float32), gradients of the true loss.

        Raises:
            ValueError: (template) gradients clipped while still scaled: in a traced step by
                TensorFlow's clipping functions, eager from `tfmp.scaled_gradients`' result
                (`guard.refuse_clipped_scaled`).
        """
        grads = list(grads)
        _guard.refuse_clipped_scaled(self, grads, self._steps.handed_out)  # clipped, then unscaled: as wrong
        scale = self.dynamic_scale if self.built else self.initial_scale
        unscaled = [None if g is None else ops.divide(g, ops.cast(scale, g.dtype)) for g in grads]
        self._origins.note(list(grads), unscaled)
        self._steps.unscaled.note()
        return unscaled

    def apply(self, grads: list, trainable_variables: list | None = None) -> None:
        """Skips or applies one step (Keras semantics), then checks for a stuck run.

        Raises:
            ValueError: in an XLA-compiled step replicated over several replicas
                (`tfmp._src.distribute`); (template) under dynamic loss scaling, gradients
                clipped while still scaled: in a traced step, or eager from `tfmp.scaled_gradients`'
                result (`guard.refuse_clipped_scaled`);
                (template) the ``"values"`` guard under a tf.distribute strategy.

        Warns:
            tfmp.LossScaleWarning: once per optimizer, when it scales dynamically and
                gradients arrive although no loss was ever scaled by it.
        """
        _distribute.check_not_xla_replicated()
        grads = list(grads)
        loss_recorded = self._steps.take_loss_recorded()
        already = self._origins.already_unscaled(grads, self._steps.unscaled.take())
        _guard.refuse_clipped_scaled(self, [None if done else g for g, done in zip(grads, already)],
                                     self._steps.take_handed_out())
        _guard.warn_if_unscaled(self, self._steps, any(already))
        resolved = _guard.resolve(self.guard, self.loss_scaling)
        check_values = resolved == "values"
        first = _guard.resolve("auto", self.loss_scaling) if check_values else resolved  # checked before the update
        if check_values and tf.distribute.has_strategy():
            raise invalid_argument(
                "guard", self.guard, "'values' outside tf.distribute strategies (its put-back writes run "
                "in a replica context, which a distributed variable refuses)",
                fix="Use guard='auto' or 'gradients' under a tf.distribute strategy.",
            )
        variables = list(trainable_variables or optimizer_variables(self))
        grads = float32_gradients(grads, variables)
        object.__setattr__(self, "_applying", _Applying(
            first if loss_recorded and first in _guard.LOSS_GUARDS else "", check_values,
            frozenset(id(g) for g, done in zip(grads, already) if done), tuple(_step_state.take(variables))))
        if not loss_recorded:
            self._record_status()  # a step without `scale_loss`: its batch's bits still explain a skip
        try:
            super().apply(grads, trainable_variables)
        finally:
            object.__setattr__(self, "_applying", _Applying())
        if tf.executing_eagerly():
            self.raise_if_stuck()

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """Refused: Keras's stateless path would skip tfmp's bounds, counters and stuck check.

        Raises:
            NotImplementedError: always, saying what to call instead.
        """
        raise NotImplementedError(
            "tfmp.LossScaleOptimizer.stateless_apply is not supported. Received: a "
            f"stateless_apply call on {self.name!r}. Expected: optimizer.apply(grads, "
            "variables) or apply_gradients, which update the loss scale, its bounds "
            "and the overflow counters in place (Keras's stateless path would skip "
            "them, and TensorFlow's optimizers have no stateless_apply). Fix: train "
            "with model.fit, or call optimizer.apply in your loop "
            "(tfmp.scaled_gradients computes the gradients)."
        )

    def _apply_inner(self, grads: list, trainable_variables: list | None) -> None:
        """The inner optimizer's `apply` of the unscaled gradients."""
        if self.loss_scaling:
            unscaled = self._applying.unscaled
            grads = [g if g is None or overwrites_with_gradient(self, v) or id(g) in unscaled
                     else ops.divide(g, self.dynamic_scale)
                     for g, v in zip(grads, trainable_variables or optimizer_variables(self))]
        masters = self.master_copies
        if masters:
            masters.refresh()
            trainable_variables = masters.substitute(trainable_variables or optimizer_variables(self))
        with fused_updates(self.inner_optimizer) if self.fused_updates else contextlib.nullcontext():
            self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        if masters:
            masters.round_to_variables()

    def _finite_step(self, grads: list, trainable_variables: list | None) -> None:
        if not self._applying.check_values:
            self._apply_inner(grads, trainable_variables)
            self._count_finite_step()
            return
        # The "values" guard: read what the step may write, write, check, put back.
        trained = list(trainable_variables or optimizer_variables(self))
        trained += self.master_copies.copies
        written = trained + list(self.inner_optimizer.variables)
        before = [tf.identity(variable) for variable in written]
        self._apply_inner(grads, trainable_variables)
        checked = trained + [v for v in self.inner_optimizer.variables if "float" in str(v.dtype)]
        finite = ops.all(ops.stack([ops.all(ops.isfinite(variable)) for variable in checked]))

        def put_back() -> None:
            for variable, value in zip(written, before):
                variable.assign(value)
            self.last_loss_status.assign(tf.bitwise.bitwise_or(self.last_loss_status.value, STATUS_BITS["values"]))
            self._non_finite_step()

        ops.cond(finite, self._count_finite_step, put_back)

    def _count_finite_step(self) -> None:
        self.total_steps.assign_add(1)
        self.consecutive_overflows.assign(0)
        self.min_scale_overflows.assign(0)
        if not self.loss_scaling:
            return

        def grow() -> None:
            self.step_counter.assign(0)
            grown = ops.minimum(ops.multiply(self.dynamic_scale, 2.0), self.max_scale)
            self.dynamic_scale.assign(ops.where(ops.isfinite(grown), grown, self.dynamic_scale))

        def count() -> None:
            self.step_counter.assign_add(1)

        ops.cond(ops.equal(self.step_counter, self.dynamic_growth_steps - 1), grow, count)

    def _non_finite_step(self) -> None:
        _step_state.put_back(self._applying.statistics)
        self.last_overflow_status.assign(self.last_loss_status)
        slot = ops.reshape(ops.mod(self.overflow_count, OVERFLOW_HISTORY), (1, 1))
        before = tf.identity(self.dynamic_scale)  # read now, before the update
        self.overflow_count.assign_add(1)
        self.consecutive_overflows.assign_add(1)
        self.last_overflow_step.assign(self.total_steps)
        self.total_steps.assign_add(1)
        self.step_counter.assign(0)
        if self.loss_scaling:
            at_floor = ops.less_equal(self.dynamic_scale, self.min_scale)
            self.min_scale_overflows.assign(ops.where(at_floor, self.min_scale_overflows + 1, 0))
            backoff = ops.greater_equal(self.consecutive_overflows, self.hysteresis)
            halved = ops.maximum(ops.multiply(self.dynamic_scale, 0.5), self.min_scale)
            lowered = ops.where(backoff, halved, self.dynamic_scale)
            self.dynamic_scale.assign(ops.where(_sound_scale(self.dynamic_scale), lowered, self.min_scale))
        after = tf.identity(self.dynamic_scale)
        for history, value in ((self.overflow_history_steps, tf.identity(self.last_overflow_step)),
                               (self.overflow_history_scales, tf.stack([before, after]))):
            history.assign(ops.scatter_update(history, slot, value[None]))

    def raise_if_stuck(self) -> None:
        """Raises (or warns) when the run keeps skipping steps.

        Called after each eager `apply` and each `model.fit` step; call it between steps
        of a custom loop running in a `tf.function`.

        Raises:
            tfmp.NonFiniteError: With `on_stuck="raise"`, when `consecutive_overflows`
                reached `max_consecutive_overflows` or `min_scale_overflows` reached
                `MIN_SCALE_PATIENCE` (3). `phase` is `"loss"` when the last loss was
                non-finite (lowering the scale cannot help), `"gradients"` otherwise;
                `step` is the last skipped step, `details["scale"]` the scale.
        """
        if self.built:
            _loops.check(self)

    def counter_variables(self) -> list:
        """tfmp's counter variables (`_COUNTERS`, then the two overflow histories); [] before `build`."""
        return [getattr(self, name) for name in _COUNTERS + _HISTORIES if name in vars(self)]

    @property
    def loss_scale_counters(self) -> _saved_form.CounterStore:
        """What Keras's saving writes the counters through (`saved_form.CounterStore`)."""
        if vars(self).get("_counter_store") is None:
            object.__setattr__(self, "_counter_store", _saved_form.CounterStore(self))  # past Keras's tracking
        return vars(self)["_counter_store"]

    def save_own_variables(self, store: Any) -> None:
        """Saves Keras's `LossScaleOptimizer`'s variables, in its order (the counters: `loss_scale_counters`)."""
        _saved_form.save_variables(_saved_form.keras_layout(self), store)

    def load_own_variables(self, store: Any) -> None:
        """Loads what `save_own_variables` saved, or every variable (earlier tfmp files); else Keras's.

        Raises:
            ValueError: (template, `state_check`) a loss scale or counter no run reaches, naming it.
        """
        if not _saved_form.load_variables(_saved_form.keras_layout(self), store, self):
            super().load_own_variables(store)

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> "LossScaleOptimizer":
        """Builds the optimizer from a config of either saved form (`saved_form.from_keras_form`)."""
        return super().from_config(_saved_form.from_keras_form(config), custom_objects=custom_objects)

    def get_config(self) -> dict:
        """Keras's config plus every tfmp argument (round-trips through `from_config`)."""
        config = super().get_config()
        tfmp_settings = WRAP_OPTIONS[2:-1]  # min_scale ... guard: not Keras's two, nor the name
        config.update({name: getattr(self, name) for name in tfmp_settings}, initial_scale=self._config_initial_scale)
        return config


# Saved files name this class by Keras's name (`saved_form`).
keras.saving.get_custom_objects()[_saved_form.KERAS_NAME] = LossScaleOptimizer
for _setting in FORWARDED_SETTINGS:
    setattr(LossScaleOptimizer, _setting, _forwarded(_setting))
del _setting

_PARAMETERS = inspect.signature(LossScaleOptimizer).parameters
#: Keyword options of `wrap_optimizer` (those of `LossScaleOptimizer`).
WRAP_OPTIONS = tuple(_PARAMETERS)[1:-1]
_COMPUTE_DTYPES = ("float16", "bfloat16", "float32", "float64")
_DEFAULT_BOUNDS = {name: _PARAMETERS[name].default for name in ("min_scale", "max_scale")}


def check_wrap_options(compute_dtype: str, **options: Any) -> None:
    """Checks `wrap_optimizer`'s options as `tfmp.LossScaleOptimizer` would, without a TensorFlow op.

    Raises:
        ValueError: (template) a value `tfmp.LossScaleOptimizer` refuses.
    """
    values = {**{name: _PARAMETERS[name].default for name in WRAP_OPTIONS},
              "loss_scaling": compute_dtype == "float16", **options}
    initial_scale, growth = values.pop("initial_scale"), values.pop("dynamic_growth_steps")
    _arguments.check_settings(initial_scale, growth, kwargs={}, **values)


def wrap_optimizer(optimizer: str | dict | keras.optimizers.Optimizer, compute_dtype: str,
                   **options: Any) -> LossScaleOptimizer:
    """Wraps an optimizer in `tfmp.LossScaleOptimizer` for a compute dtype.

    Dynamic loss scaling when `compute_dtype` is `"float16"`; otherwise the scale is fixed
    at 1.0 (`loss_scaling=False`) and non-finite steps are still skipped and counted. An
    explicit `loss_scaling` option wins.

    Args:
        optimizer: `keras.optimizers.Optimizer`, string (e.g. `"adam"`) or config dict.
            A `tfmp.LossScaleOptimizer` is returned unchanged; a Keras `LossScaleOptimizer`
            is rewrapped, keeping its `initial_scale` and `dynamic_growth_steps` unless
            options set them (the default bounds widen to hold that scale), with one
            warning (`user_settings`).
        compute_dtype: String, one of `"float16"`, `"bfloat16"`, `"float32"`, `"float64"`.
        **options: Keyword arguments of `tfmp.LossScaleOptimizer`.

    Returns:
        `tfmp.LossScaleOptimizer`.

    Raises:
        ValueError: (template) an unknown option or dtype.

    Warns:
        tfmp.LossScaleWarning: once per Keras `LossScaleOptimizer` replaced.
    """
    for key in options:
        if key not in WRAP_OPTIONS:
            raise invalid_argument("options", key, f"one of {', '.join(WRAP_OPTIONS)}", choices=WRAP_OPTIONS)
    if compute_dtype not in _COMPUTE_DTYPES:
        raise invalid_argument("compute_dtype", compute_dtype, "one of " + ", ".join(_COMPUTE_DTYPES),
                               choices=_COMPUTE_DTYPES)
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    options.setdefault("loss_scaling", compute_dtype == "float16")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        options = _user_settings.take_keras_settings(optimizer, options, _DEFAULT_BOUNDS)
        wrapped = LossScaleOptimizer(optimizer.inner_optimizer, **options)  # raises before any warning
        _user_settings.warn_keras_optimizer_replaced(optimizer, options, compute_dtype)
        return wrapped
    return LossScaleOptimizer(keras.optimizers.get(optimizer), **options)
