"""Loss scaling that never fails silently: `tfmp.LossScaleOptimizer`.

Keras's `LossScaleOptimizer` halves the scale on every non-finite step without a
floor, doubles it without a ceiling and counts nothing. The subclass below keeps all
of Keras's behaviour and adds scale bounds, hysteresis, overflow counters kept as
optimizer variables (so checkpoints carry them), a fixed-scale guard for bfloat16 and
float32 runs (skipping a step whose batch or loss is non-finite; see `guard.py`), a warning
for gradients of a loss it never scaled, and stuck detection that stops
`model.fit` with `tfmp.NonFiniteError`.

Number sources: float16's largest finite value is 65504, so gradients above that
overflow to inf; the default `max_scale` of 2**24 is NVIDIA apex's cap; the default
initial scale 2**15 and growth interval 2000 are Keras's.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Dict

import keras
import tensorflow as tf
from keras import ops

from tfmp._src import distribute as _distribute
from tfmp._src.loss_scale import arguments as _arguments
from tfmp._src.loss_scale import guard as _guard
from tfmp._src.loss_scale import loops as _loops
from tfmp._src.loss_scale import saved_form as _saved_form
from tfmp._src.loss_scale import step_state as _step_state
from tfmp._src.loss_scale import user_settings as _user_settings
from tfmp._src.errors import invalid_argument
from tfmp._src.float32.master_weights import warn_16bit_applied
from tfmp._src.keras_hooks.optimizer_steps import (
    LossScaleOptimizerBase,
    no_automatic_dependency_tracking,
    optimizer_variables,
    overwrites_with_gradient,
)
from tfmp._src.loss_scale.fused_update import fused_updates
from tfmp._src.loss_scale.loops import DEFAULT_MAX_CONSECUTIVE_OVERFLOWS
from tfmp._src.policy import speedups

_INT = "int64"
_COUNTERS = (
    "overflow_count",
    "consecutive_overflows",
    "last_overflow_step",
    "total_steps",
    "min_scale_overflows",
    "last_loss_status",
    "last_overflow_status",
)
#: Names of the scalar state variables: Keras's two, then tfmp's counters.
STATE_VARIABLES = ("dynamic_scale", "step_counter") + _COUNTERS
#: Settings of Keras's base optimizer that live on the inner optimizer: reading or
#: writing them on the wrapper reaches the inner one (Keras's own wrapper forwards
#: only `learning_rate`). `loss_scale_factor` is not among them: the wrapper scales.
FORWARDED_SETTINGS = (
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "gradient_accumulation_steps",
)
#: Bits of `last_loss_status`: what the last step found non-finite.
STATUS_BITS = {"loss nan": 1, "loss inf": 2, "batch nan": 4, "batch inf": 8, "values": 16}
_LOSS_BITS = 1 | 2
#: Length of the overflow history ring buffers (`overflow_history_steps`,
#: `overflow_history_scales`): how many skipped steps a reader polling between
#: steps (tfmp.LossScaleMonitor) can itemize; older ones are only counted.
OVERFLOW_HISTORY = 64


def _status(flags: Dict[str, Any]) -> Any:
    """Int64 scalar tensor: the `STATUS_BITS` of the names whose bool tensor in `flags` is True."""
    return sum(ops.cast(flag, _INT) * STATUS_BITS[name] for name, flag in flags.items())


def _forwarded(name: str) -> property:
    """A property reading and writing `name` on the inner optimizer.

    Before the inner optimizer exists (Keras's base `__init__`) and while the
    wrapper builds its own variables (Keras's base `build` reads `use_ema` and
    `gradient_accumulation_steps` to create EMA and accumulator variables, which
    belong to the inner optimizer only), the wrapper's own value is used.
    """

    def read(self: Any) -> Any:
        inner = vars(self).get("inner_optimizer")
        if inner is None or vars(self).get("_tfmp_building"):
            return vars(self).get("_tfmp_own_settings", {}).get(name)
        return getattr(inner, name)

    def write(self: Any, value: Any) -> None:
        inner = vars(self).get("inner_optimizer")
        if inner is None:
            own = vars(self).setdefault("_tfmp_own_settings", {})
            own[name] = value
        else:
            setattr(inner, name, value)

    return property(read, write, doc=f"The inner optimizer's `{name}` (read and written there).")


@keras.saving.register_keras_serializable(package="tfmp")
class LossScaleOptimizer(LossScaleOptimizerBase):
    """Keras's `LossScaleOptimizer` with counters, bounds and stuck detection.

    On a step with finite gradients the gradients are divided by the scale and handed
    to `inner_optimizer`; after `dynamic_growth_steps` finite steps in a row the scale
    doubles, capped at `max_scale`. On a non-finite step (by default: a non-finite
    gradient with loss scaling, a non-finite batch or loss without; see `guard`) the update
    is skipped, the counters go up and, once `hysteresis` non-finite steps came in
    a row, the scale halves, never below `min_scale`. The inner optimizer's `iterations` does not
    advance on a skipped step, so learning-rate schedules do not either; `total_steps`
    counts every step.

    Optimizer variables (scalars, created in `build`, saved in checkpoints):
    `dynamic_scale` (float32, the scale), `step_counter` (finite steps since the last
    scale change), `overflow_count` (int64, skipped steps in total),
    `consecutive_overflows` (int64), `last_overflow_step` (int64, value of
    `total_steps` before the last skipped step, i.e. its zero-based index; -1 if
    none), `total_steps` (int64, every `apply` call), `min_scale_overflows` (int64,
    consecutive skipped steps taken at `min_scale`) and `last_loss_status` (int64,
    the last step's findings, on any replica: bit 1 = NaN, bit 2 = inf in the
    loss passed to `scale_loss`; bit 4 = NaN, bit 8 = inf in the batch of
    Keras's train step (recorded under every guard, to name the cause of a
    skip); bit 16 = a value
    the step would write into a trainable variable was not finite, with
    ``"values"``; see `STATUS_BITS`) and `last_overflow_status` (int64, the same
    bits as they were at the last skipped step: what the warnings explain).
    Overflow
    history, ring buffers indexed by `overflow_count % OVERFLOW_HISTORY` (64): the
    k-th skipped step's zero-based index in `overflow_history_steps` (int64, -1 if
    none) and its scale before and after the step in `overflow_history_scales`
    (float32, shape (64, 2)).

    Stuck detection: after `max_consecutive_overflows` skipped steps in a row, or
    `MIN_SCALE_PATIENCE` (3) in a row at `min_scale`, `raise_if_stuck` raises
    `tfmp.NonFiniteError` (or warns, with `on_stuck="warn"`). It runs after every
    eager `apply` and after every `model.fit` step.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer`. The optimizer to wrap; its
            clipping, weight decay and gradient accumulation see unscaled gradients.
        initial_scale: Float. The loss scale at step 0; must lie in
            [`min_scale`, `max_scale`]. Default 2**15 (Keras).
        dynamic_growth_steps: Int >= 1. Finite steps in a row before the scale doubles.
        min_scale: Float > 0. The scale never goes below this. Default 1.0.
        max_scale: Float. The scale never grows above this. Default 2**24 (apex).
        hysteresis: Int >= 1. Non-finite steps in a row before the first halving
            (DeepSpeed's option); 1 is Keras's behaviour.
        max_consecutive_overflows: Int >= 1. Skipped steps in a row that count as
            stuck. Default `DEFAULT_MAX_CONSECUTIVE_OVERFLOWS` (32).
        on_stuck: String, `"raise"` (default) or `"warn"` (keep training, warn once
            per stuck run).
        loss_scaling: Bool. False fixes the scale at 1.0 (for bfloat16 or float32
            compute) while non-finite steps are still skipped and counted.
        guard: String, what a step is checked for (see
            `tfmp._src.loss_scale.guard`; costs in `benchmarks/guard_cost.py`
            and README): `"batch"` (the loss given to `scale_loss` and every
            gradient are finite, and the train step's batch is checked to name
            the cause of a skip: a bad batch or the backward pass; only with
            `loss_scaling=False`), `"loss"` (the loss alone, so no update waits
            for the backward pass to end; only with `loss_scaling=False`),
            `"gradients"` (every gradient finite; what loss scaling needs),
            `"values"` (the first check, then every value
            the step writes into a trainable variable is finite, else the
            step's writes are put back; not under a tf.distribute strategy), or `"auto"`
            (default): `"gradients"` with loss scaling, `"batch"` without. A
            step applied without `scale_loss` gets the gradients check.
        name: String or None. The optimizer's name.
        **kwargs: Keras's backwards-compatibility arguments (`dynamic=True` and the
            base optimizer's defaults); anything else raises ValueError.

    Speed: `fused_updates` (bool attribute, not saved): True runs an inner Adam's
    or SGD's update on TensorFlow's fused training kernel
    (`tfmp._src.loss_scale.fused_update`, same formulas). Default: True where
    no GPU or TPU runs the steps (measured on CPUs only), unless the thread
    making the optimizer is under ``tfmp.enable(speedups=False)`` or
    ``{"fused_update": False}``; tfmp also sets it False on the optimizer of a
    model it compiles or loads with that switch off. Read when a step is
    traced: set it before the first `fit` (or call
    ``model.make_train_function(force=True)``).

    Transparent: the inner optimizer's settings (`learning_rate`, `weight_decay`,
    `clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`, `ema_momentum`,
    `ema_overwrite_frequency`, `gradient_accumulation_steps`, and any public
    attribute of the inner optimizer's class such as Adam's `beta_1`) are read and
    written through the wrapper, and `exclude_from_weight_decay` reaches it too.
    Setting `loss_scale_factor` on the wrapper raises: the wrapper does the scaling.

    Raises:
        ValueError: (template, naming the argument) see
            `tfmp._src.loss_scale.arguments.check_arguments`. An
            `inner_optimizer` that is itself a loss-scale optimizer (tfmp's or
            Keras's) is refused, not unwrapped: its settings (scale, bounds,
            guard) would have to be merged with this call's or silently
            dropped, and code that kept a reference to it would keep training
            with a second, stale scale; the message names the fix,
            ``LossScaleOptimizer(opt.inner_optimizer, ...)``.

    Example:
        >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10)
        >>> opt.loss_scale
        1024.0
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        *,
        min_scale: float = _arguments.DEFAULT_MIN_SCALE,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        max_consecutive_overflows: int = DEFAULT_MAX_CONSECUTIVE_OVERFLOWS,
        on_stuck: str = "raise",
        loss_scaling: bool = True,
        guard: str = "auto",
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        _arguments.check_arguments(
            inner_optimizer, initial_scale, dynamic_growth_steps, min_scale=min_scale,
            max_scale=max_scale, hysteresis=hysteresis, max_consecutive_overflows=max_consecutive_overflows,
            on_stuck=on_stuck, loss_scaling=loss_scaling, guard=guard, name=name, kwargs=kwargs,
        )
        # Keras's build and scale_loss read `initial_scale`: without loss scaling it
        # is 1.0 while get_config keeps the value the caller gave.
        super().__init__(
            inner_optimizer,
            float(initial_scale) if loss_scaling else 1.0,
            dynamic_growth_steps,
            name=name,
            **kwargs,
        )
        self._config_initial_scale = initial_scale
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.hysteresis = hysteresis
        self.max_consecutive_overflows = max_consecutive_overflows
        self.on_stuck = on_stuck
        self.loss_scaling = loss_scaling
        self.guard = guard
        self.fused_updates = speedups.on_now("fused_update")
        self._warned_run = None
        self._warned_fit = None  # the fit (its starting counters) `skips.warn_early` warned about
        self._checked_overflows = 0  # overflow_count at the last `raise_if_stuck` (None: check again)
        self._steps = _guard.StepRecord()  # scale_loss calls, per traced or eager step
        self._check_loss = ""  # "batch" or "loss" inside an `apply` checking that, not the gradients
        self._check_values = False  # True inside an `apply` with the "values" guard
        self._already_unscaled: set = set()  # inside an `apply`: ids of gradients not to divide again
        # BatchNormalization statistics a skipped step puts back; set past Keras's
        # tracking, which would make the statistics optimizer variables (saved with it).
        object.__setattr__(self, "_statistics_before", ())
        # What get_unscaled_gradients took and handed back: apply does not divide
        # the latter again (tf.keras 2 code unscales before apply_gradients).
        self._origins = _guard.GradientOrigins()
        _loops.track(self)

    def __repr__(self) -> str:
        """E.g. ``tfmp.LossScaleOptimizer(Adam, name='loss_scale_optimizer'): dynamic loss scale 32768, guard='auto'``."""
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
        # Only called when normal lookup fails: public settings of the inner
        # optimizer's class (e.g. Adam's beta_1) read through the wrapper.
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
        if (
            inner is not None
            and not name.startswith("_")
            and name not in vars(self)
            and not hasattr(type(self), name)
            and hasattr(type(inner), name) is False
            and name in vars(inner)
        ):
            setattr(inner, name, value)  # e.g. Adam's beta_1, an attribute of the inner optimizer
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
            super().build(var_list)
        finally:
            object.__setattr__(self, "_tfmp_building", False)
        for name in _COUNTERS:
            start = keras.initializers.Constant(
                -1 if name == "last_overflow_step" else 0
            )
            setattr(self, name, self.add_variable((), start, _INT, name=name))
        self.overflow_history_steps = self.add_variable(
            (OVERFLOW_HISTORY,),
            keras.initializers.Constant(-1),
            _INT,
            name="overflow_history_steps",
        )
        self.overflow_history_scales = self.add_variable(
            (OVERFLOW_HISTORY, 2), "zeros", "float32", name="overflow_history_scales"
        )

    @property
    def loss_scale(self) -> float:
        """Float. The current loss scale (the initial one before `build`)."""
        return float(self.dynamic_scale.numpy() if self.built else self.initial_scale)

    def record_batch(self, data: Any) -> None:
        """Records whether the train step's batch is finite, for the ``"batch"`` guard.

        Called by tfmp as Keras's ``train_step(data)`` starts
        (`tfmp._src.loss_scale.batch_check`); the next `scale_loss` of the same
        step stores the finding in `last_loss_status` (bits 4 and 8).

        Args:
            data: The nest ``train_step`` receives (``(x, y, sample_weight)``,
                dicts...). Its float tensors are checked; other leaves are not.
        """
        leaves = [
            leaf for leaf in tf.nest.flatten(data)
            if isinstance(leaf, tf.Tensor) and leaf.dtype.is_floating
        ]
        if not leaves:
            return
        nan = tf.reduce_any([tf.reduce_any(tf.math.is_nan(leaf)) for leaf in leaves])
        inf = tf.reduce_any([tf.reduce_any(tf.math.is_inf(leaf)) for leaf in leaves])
        self._steps.note_batch((nan, inf))

    def _record_unscaled_batch(self) -> None:
        """A step without `scale_loss` (a custom ``train_step``): its batch's bits still explain a skip."""
        batch = self._steps.take_batch_status()
        if batch is not None and self.built:
            nan, inf = _distribute.any_replica(list(batch))
            self.last_loss_status.assign(_status({"batch nan": nan, "batch inf": inf}))

    def scale_loss(self, loss: Any) -> Any:
        """Multiplies `loss` by the scale, recording whether the loss (and the batch) is finite.

        Keras's TF trainer calls this on the unscaled loss before the gradients, so
        stuck detection can tell a non-finite loss from gradient overflow, and
        the ``"batch"`` and ``"loss"`` guards skip a step whose batch or loss is
        non-finite.
        """
        self._steps.note_scale_loss(self.built)
        batch = self._steps.take_batch_status()
        if self.built:
            value = ops.convert_to_tensor(loss)
            flags = [ops.any(ops.isnan(value)), ops.any(ops.isinf(value))]
            flags += list(batch) if batch is not None else []
            names = ("loss nan", "loss inf", "batch nan", "batch inf")
            self.last_loss_status.assign(_status(dict(zip(names, _distribute.any_replica(flags)))))
        if not self.loss_scaling:
            return loss  # the scale is fixed at 1.0: nothing to multiply (nor divide in apply)
        return super().scale_loss(loss)

    def check_finite(self, grads: list) -> Any:
        """Scalar bool tensor: True when the gradients are finite on every replica.

        Keras checks only this replica's gradients and, under `MirroredStrategy`,
        keeps replica 0's answer; here the answer is combined over all replicas in
        sync (see `tfmp._src.distribute`), so all of them skip the same steps.
        Inside an `apply` checking the loss (the ``"loss"`` guard), the answer
        is whether the loss recorded by `scale_loss` was finite on every replica;
        with the ``"batch"`` guard, that and every gradient (the batch's status
        only names the cause of a skip).
        """
        if self._check_loss:
            status = self.last_loss_status.value
            loss_finite = ops.equal(tf.bitwise.bitwise_and(status, _LOSS_BITS), 0)
            if self._check_loss == "loss":
                return loss_finite
            # "batch": the loss and every gradient; the batch's bits only name the cause.
            return ops.logical_and(loss_finite, self._gradients_finite(grads))
        return self._gradients_finite(grads)

    def _gradients_finite(self, grads: list) -> Any:
        return _distribute.all_replicas_finite(super().check_finite(grads))

    def get_scaled_loss(self, loss: Any) -> Any:
        """Alias of `scale_loss`, under its tf.keras 2 name."""
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: list) -> list:
        """Divides `grads` by the scale, as tf.keras 2 did.

        For code moved from tf.keras 2. Nothing about the optimizer changes.
        `apply` / `apply_gradients` in the same step (the same traced function,
        or the next eager `apply`) take the gradients as unscaled and do not
        divide them again, also after any op on them (clipping, a cast,
        ``tf.identity``); outside such a step the tensors it returns are still
        recognised; any other gradient is unscaled there exactly once.

        Args:
            grads: List of tensors or None. Gradients of the scaled loss.

        Returns:
            List of tensors (float32 where given float32), gradients of the true loss.

        Raises:
            ValueError: (template) in a traced step, gradients clipped by
                TensorFlow's clipping functions while still scaled
                (`guard.refuse_clipped_scaled`): unscale first, then clip.
        """
        grads = list(grads)
        _guard.refuse_clipped_scaled(self, grads)  # clipped, then unscaled: as wrong
        scale = self.dynamic_scale if self.built else self.initial_scale
        unscaled = [None if g is None else ops.divide(g, ops.cast(scale, g.dtype)) for g in grads]
        self._origins.note(list(grads), unscaled)
        self._steps.note_unscaled()
        return unscaled

    def apply(self, grads: list, trainable_variables: list | None = None) -> None:
        """Skips or applies one step (Keras semantics), then checks for a stuck run.

        The step is skipped when its `guard` check fails: the gradients, or the
        loss recorded by `scale_loss` in the same step (see `guard`).

        Raises:
            ValueError: when traced in an XLA-compiled step replicated over several
                replicas of a `tf.distribute` strategy (see `tfmp._src.distribute`);
                (template) with dynamic loss scaling, gradients clipped by
                TensorFlow's clipping functions while still scaled, in a traced step
                (`guard.refuse_clipped_scaled`).

        Warns:
            tfmp.LossScaleWarning: once per optimizer, when it scales dynamically
                and gradients arrive although no loss was ever scaled by it.
        """
        _distribute.check_not_xla_replicated()
        grads = list(grads)
        loss_recorded = self._steps.take_loss_recorded()
        already = self._origins.already_unscaled(grads, self._steps.take_unscaled())
        _guard.refuse_clipped_scaled(self, [g for g, done in zip(grads, already) if not done])
        _guard.warn_if_unscaled(self, self._steps, any(already))
        self._already_unscaled = {id(g) for g, done in zip(grads, already) if done}
        first = _guard.first_check(self.guard, self.loss_scaling)
        self._check_loss = first if loss_recorded and first in _guard.LOSS_GUARDS else ""
        self._check_values = _guard.resolve(self.guard, self.loss_scaling) == "values"
        if self._check_values and tf.distribute.has_strategy():
            raise invalid_argument(
                "guard", self.guard, "'values' outside tf.distribute strategies (its put-back writes run "
                "in a replica context, which a distributed variable refuses)",
                fix="Use guard='auto' or 'gradients' under a tf.distribute strategy.",
            )
        variables = list(trainable_variables or optimizer_variables(self))
        warn_16bit_applied(self, variables)
        object.__setattr__(self, "_statistics_before", tuple(_step_state.take(variables)))
        if not loss_recorded:
            self._record_unscaled_batch()
        try:
            super().apply(grads, trainable_variables)
        finally:
            self._check_loss, self._check_values, self._already_unscaled = "", False, set()
            object.__setattr__(self, "_statistics_before", ())
        if tf.executing_eagerly():
            self.raise_if_stuck()

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """Refused: the step must update the scale bounds and counters in place.

        Keras's `LossScaleOptimizer.stateless_apply` runs its own
        ``_stateless_handle_*`` path, which would skip tfmp's bounds, hysteresis,
        overflow counters and stuck check without a word; and TensorFlow's
        optimizers refuse ``stateless_apply`` anyway (incompatible with
        `tf.distribute`).

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

    def _unscale(self, grads: list, trainable_variables: list | None) -> list:
        if not self.loss_scaling:
            return grads
        variables = trainable_variables or optimizer_variables(self)
        return [
            g
            if g is None or overwrites_with_gradient(self, v) or id(g) in self._already_unscaled
            else ops.divide(g, self.dynamic_scale)
            for g, v in zip(grads, variables)
        ]

    def _apply_inner(self, grads: list, trainable_variables: list | None) -> None:
        """The inner optimizer's `apply` of the unscaled gradients (Adam's and SGD's on one
        kernel, `tfmp._src.loss_scale.fused_update`)."""
        with fused_updates(self.inner_optimizer) if self.fused_updates else contextlib.nullcontext():
            self.inner_optimizer.apply(
                self._unscale(grads, trainable_variables), trainable_variables=trainable_variables
            )

    def _finite_step(self, grads: list, trainable_variables: list | None) -> None:
        if not self._check_values:
            self._apply_inner(grads, trainable_variables)
            self._count_finite_step()
            return
        # The "values" guard: read what the step may write, write, check, put back.
        trained = list(trainable_variables or optimizer_variables(self))
        written = trained + list(self.inner_optimizer.variables)
        before = [tf.identity(variable) for variable in written]
        self._apply_inner(grads, trainable_variables)
        checked = trained + [v for v in self.inner_optimizer.variables if "float" in str(v.dtype)]
        finite = ops.all(ops.stack([ops.all(ops.isfinite(variable)) for variable in checked]))

        def put_back() -> None:
            for variable, value in zip(written, before):
                variable.assign(value)
            self.last_loss_status.assign(
                tf.bitwise.bitwise_or(self.last_loss_status.value, STATUS_BITS["values"]))
            self._non_finite_step()

        ops.cond(finite, self._count_finite_step, put_back)

    def _count_finite_step(self) -> None:
        self.total_steps.assign_add(1)
        self.consecutive_overflows.assign(0)
        self.min_scale_overflows.assign(0)
        if not self.loss_scaling:
            return

        def grow():
            self.step_counter.assign(0)
            grown = ops.minimum(ops.multiply(self.dynamic_scale, 2.0), self.max_scale)
            self.dynamic_scale.assign(
                ops.where(ops.isfinite(grown), grown, self.dynamic_scale)
            )

        def count():
            self.step_counter.assign_add(1)

        ops.cond(
            ops.equal(self.step_counter, self.dynamic_growth_steps - 1), grow, count
        )

    def _non_finite_step(self) -> None:
        _step_state.put_back(self._statistics_before)
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
            self.min_scale_overflows.assign(
                ops.where(at_floor, self.min_scale_overflows + 1, 0)
            )
            backoff = ops.greater_equal(self.consecutive_overflows, self.hysteresis)
            halved = ops.maximum(ops.multiply(self.dynamic_scale, 0.5), self.min_scale)
            self.dynamic_scale.assign(ops.where(backoff, halved, self.dynamic_scale))
        after = tf.identity(self.dynamic_scale)
        for history, value in (
            (self.overflow_history_steps, tf.identity(self.last_overflow_step)),
            (self.overflow_history_scales, tf.stack([before, after])),
        ):
            history.assign(ops.scatter_update(history, slot, value[None]))

    def raise_if_stuck(self) -> None:
        """Raises (or warns) when the run keeps skipping steps.

        Called for you after each eager `apply` and after each `model.fit` step; call
        it between steps of a custom loop running in a `tf.function`.

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
        names = _COUNTERS + ("overflow_history_steps", "overflow_history_scales")
        return [getattr(self, name) for name in names if name in vars(self)]

    @property
    def loss_scale_counters(self) -> _saved_form.CounterStore:
        """What Keras's saving writes the counters through (`saved_form.CounterStore`)."""
        store = vars(self).get("_counter_store")
        if store is None:
            store = _saved_form.CounterStore(self)
            object.__setattr__(self, "_counter_store", store)  # past Keras's tracking
        return store

    def save_own_variables(self, store: Any) -> None:
        """Saves the variables Keras's `LossScaleOptimizer` has, in its order (see `saved_form`).

        tfmp's counters are saved apart, through `loss_scale_counters`, so that
        plain Keras loads this optimizer's state as its own.
        """
        _saved_form.save_variables(_saved_form.keras_layout(self, self.counter_variables()), store)

    def load_own_variables(self, store: Any) -> None:
        """Loads what `save_own_variables` saved, or every variable (files of earlier tfmp versions).

        A store of another length is left to Keras (which skips it with a warning).
        """
        if not _saved_form.load_variables(_saved_form.keras_layout(self, self.counter_variables()), store):
            super().load_own_variables(store)

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> "LossScaleOptimizer":
        """Builds the optimizer from a config of either saved form (`saved_form.from_keras_form`)."""
        return super().from_config(_saved_form.from_keras_form(config), custom_objects=custom_objects)

    def get_config(self) -> dict:
        """Keras's config plus every tfmp argument (round-trips through `from_config`)."""
        config = super().get_config()
        config.update(
            initial_scale=self._config_initial_scale,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            hysteresis=self.hysteresis,
            max_consecutive_overflows=self.max_consecutive_overflows,
            on_stuck=self.on_stuck,
            loss_scaling=self.loss_scaling,
            guard=self.guard,
        )
        return config


# The Keras form of saved files (`saved_form.keras_form`) names this class by
# Keras's name; where tfmp is imported, that name resolves to tfmp's class.
keras.saving.get_custom_objects()[_saved_form.KERAS_NAME] = LossScaleOptimizer

for _setting in FORWARDED_SETTINGS:
    setattr(LossScaleOptimizer, _setting, _forwarded(_setting))
del _setting

# Keyword arguments of LossScaleOptimizer that wrap_optimizer passes on.
#: Keyword options of `wrap_optimizer` (those of `LossScaleOptimizer`).
WRAP_OPTIONS = tuple(inspect.signature(LossScaleOptimizer).parameters)[1:-1]
_COMPUTE_DTYPES = ("float16", "bfloat16", "float32", "float64")
_DEFAULT_BOUNDS = {name: inspect.signature(LossScaleOptimizer).parameters[name].default
                   for name in ("min_scale", "max_scale")}


def check_wrap_options(compute_dtype: str, **options: Any) -> None:
    """Checks `wrap_optimizer`'s options as `tfmp.LossScaleOptimizer` would, making none.

    Creates no variable and runs no TensorFlow op (a throwaway optimizer would
    start TensorFlow's runtime, which must wait for a multi-worker strategy).

    Args:
        compute_dtype: String, as for `wrap_optimizer`.
        **options: Keyword arguments of `tfmp.LossScaleOptimizer`, all in `WRAP_OPTIONS`.

    Raises:
        ValueError: (template) a value `tfmp.LossScaleOptimizer` refuses.
    """
    parameters = inspect.signature(LossScaleOptimizer).parameters
    values = {name: parameters[name].default for name in WRAP_OPTIONS}
    values["loss_scaling"] = compute_dtype == "float16"
    values.update(options)
    initial_scale, growth = values.pop("initial_scale"), values.pop("dynamic_growth_steps")
    _arguments.check_settings(initial_scale, growth, kwargs={}, **values)


def wrap_optimizer(
    optimizer: str | dict | keras.optimizers.Optimizer,
    compute_dtype: str,
    **options: Any,
) -> LossScaleOptimizer:
    """Wraps an optimizer in `tfmp.LossScaleOptimizer` for a compute dtype.

    Dynamic loss scaling is used when `compute_dtype` is `"float16"`; for other
    dtypes the scale is fixed at 1.0 (`loss_scaling=False`) and steps with a
    non-finite loss (the default `guard="auto"`; every gradient with
    `guard="gradients"`) are still skipped and counted. An explicit
    `loss_scaling` option wins.

    Args:
        optimizer: `keras.optimizers.Optimizer`, string (e.g. `"adam"`) or config
            dict. A `tfmp.LossScaleOptimizer` is returned unchanged; a Keras
            `LossScaleOptimizer` is unwrapped and rewrapped, keeping its
            `initial_scale` and `dynamic_growth_steps` unless options set them
            (the default bounds widen to hold that `initial_scale`), with one
            warning (`tfmp._src.loss_scale.user_settings`).
        compute_dtype: String. The layers' compute dtype, one of `"float16"`,
            `"bfloat16"`, `"float32"`, `"float64"`.
        **options: Keyword arguments of `tfmp.LossScaleOptimizer`.

    Returns:
        `tfmp.LossScaleOptimizer`.

    Raises:
        ValueError: In the project's template, for an unknown option or dtype.

    Warns:
        tfmp.LossScaleWarning: once per Keras `LossScaleOptimizer` replaced,
            naming its settings, what the replacement changes (a scale fixed at
            1.0 when `compute_dtype` is not float16) and how to keep Keras's.
    """
    for key in options:
        if key not in WRAP_OPTIONS:
            raise invalid_argument(
                "options",
                key,
                f"one of {', '.join(WRAP_OPTIONS)}",
                choices=WRAP_OPTIONS,
            )
    if compute_dtype not in _COMPUTE_DTYPES:
        raise invalid_argument(
            "compute_dtype",
            compute_dtype,
            "one of " + ", ".join(_COMPUTE_DTYPES),
            choices=_COMPUTE_DTYPES,
        )
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    options.setdefault("loss_scaling", compute_dtype == "float16")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        keras_optimizer, optimizer = optimizer, optimizer.inner_optimizer
        options = _user_settings.take_keras_settings(keras_optimizer, options, _DEFAULT_BOUNDS)
        wrapped = LossScaleOptimizer(optimizer, **options)  # raises before any warning
        _user_settings.warn_keras_optimizer_replaced(keras_optimizer, options, compute_dtype)
        return wrapped
    return LossScaleOptimizer(keras.optimizers.get(optimizer), **options)
