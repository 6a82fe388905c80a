"""`tfmp.check_numerics`: name the first layer that goes NaN or Inf, and live with loss scaling.

`tf.debugging.enable_check_numerics()` aborts healthy float16 runs, whose scaled gradients
overflow on purpose. These hooks check layer outputs, loss terms and the loss forward, and
gradients backward; under a dynamic scale a non-finite gradient counts only at the scale's
floor. Results go to variables and a flag in the step's logs, read after every step.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any, Callable, Optional

import keras
import tensorflow as tf

from tfmp._src.errors import (NonFiniteError, check_bool, check_model, check_positive_int, invalid_argument,
                              model_fix, warn_error)
from tfmp._src.keras_hooks import layer_calls, loss_terms, optimizer_steps, surfaces, train_function, trainer
from tfmp._src.keras_hooks.optimizer_steps import optimizer_variables
from tfmp._src.monitor.metrics import scales_loss
from tfmp._src.numerics.layers import (LayerSpec, check_layer_spec, layer_paths, reduction_hint,
                                       scale_and_counts, select_layers)
from tfmp._src.numerics.backward import Boundary, call_with_probes, trainable_ids
from tfmp._src.numerics.record import LOSS_ENTRY, FailureRecorder, StepTrace, entry_row
from tfmp._src.numerics.report import build_error
from tfmp._src.numerics.terms import term_entries

_ACTIONS = ("raise", "warn", "log")
_PHASES = ("forward", "backward", "both")
_ATTR = "_tfmp_numerics"
_MAX_FAILURES = 100
#: Largest `trace_length`: the trace is for a person to read, and each row costs two
#: float32 rows of 6 in device memory (48 bytes).
MAX_TRACE_LENGTH = 1024
#: How to fix a `model` argument that is not a model (or `None`).
_MODEL_FIX = model_fix("tfmp.check_numerics(model, action='warn')")

#: The surface of each method `NumericsHandle` hooks.
_SURFACE_OF = {"call": layer_calls.SURFACE, "train_step": trainer.SURFACE,
               "apply": optimizer_steps.SURFACE, "scale_loss": optimizer_steps.SURFACE}


def check_options(action: Any, phase: Any, layers: Any, trace_length: Any) -> None:
    """Checks the options of `check_numerics` (also `enable(debug={...})`'s); raises `ValueError`."""
    if not isinstance(action, str) or action not in _ACTIONS:
        raise invalid_argument("action", action, "one of 'raise', 'warn', 'log'", choices=_ACTIONS,
                               fix="Pass e.g. action='warn' (report and go on); 'raise' (the default) stops the run.")
    if not isinstance(phase, str) or phase not in _PHASES:
        raise invalid_argument("phase", phase, "one of 'forward', 'backward', 'both'", choices=_PHASES,
                               fix="Pass e.g. phase='both' (the default: layer outputs and gradients).")
    check_layer_spec(layers)
    check_positive_int(
        "trace_length", trace_length, maximum=MAX_TRACE_LENGTH,
        why="a trace is read by a person, and each row costs 48 bytes of device memory",
        fix="Pass e.g. trace_length=8 (the default).",
    )


#: Key of the failure flag the hooked train step adds to its logs (removed before Keras sees them).
_FLAG = "_tfmp_numerics_failed"
_local = threading.local()
logger = logging.getLogger("tfmp")


def _active_trace(handle: "NumericsHandle") -> Optional[StepTrace]:
    """The step being recorded for `handle`, if the caller runs in the step's graph."""
    trace = getattr(_local, "trace", None)
    if trace is None or trace.owner is not handle or tf.compat.v1.get_default_graph() is not trace.graph:
        return None
    return trace


class NumericsHandle:
    """The hooks installed by `tfmp.check_numerics` on one model.

    Attributes:
        model: `keras.Model`. The instrumented model.
        action: String. `"raise"`, `"warn"` or `"log"`.
        phase: String. `"forward"`, `"backward"` or `"both"`.
        layers: List of `keras.layers.Layer`. The hooked layers: their outputs are
            checked in the forward phase, the gradients at their outputs, inputs
            and weights in the backward phase.
        failures: List of `tfmp.NonFiniteError`. Failures met so far (with
            `"warn"`/`"log"`, up to 100; with `"raise"`, the one raised).
        active: Bool. False once `remove()` ran.
        recorder: `FailureRecorder`. The variables the steps write; `recorder.step`
            (scalar int64) counts the train steps checked so far.

    Use as a context manager to remove the hooks on exit.
    """

    def __init__(self, model: keras.Model, action: str, phase: str, layers: LayerSpec, trace_length: int) -> None:
        """Selects the layers to hook; `tfmp.check_numerics` installs the hooks.

        Raises:
            ValueError: (template) an argument `tfmp.check_numerics` refuses.
        """
        check_model("model", model, expected="a keras.Model instance", fix=_MODEL_FIX)
        check_options(action, phase, layers, trace_length)
        self.model, self.action, self.phase = model, action, phase
        selected = select_layers(model, layers)
        self.layers = [layer for layer, _ in selected]
        self._paths = [path for _, path in selected]
        self.recorder = FailureRecorder(trace_length, model.distribute_strategy)
        self.failures: list[NonFiniteError] = []
        self.active = True
        self._hooks: list[surfaces.Hook] = []
        self._hooked_optimizers: list[Any] = []
        self._reported: set = set()

    def _hook(self, target: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
        surface = _SURFACE_OF[name]
        self._hooks.append(surface.subscribe(target, name, wrap, owner="numerics"))

    def _install(self) -> None:
        for layer, path in zip(self.layers, self._paths):
            self._hook(layer, "call", functools.partial(self._wrap_call, layer, path))
        self._hook(self.model, "train_step", self._wrap_train_step)
        object.__setattr__(self.model, _ATTR, self)
        self.model.train_function = None  # rebuilt with the hooks by the next fit
        train_function.add_check(self.model, "numerics", self._check_logs)

    def remove(self) -> None:
        """Removes every hook; the next `fit` rebuilds a train function without them."""
        if not self.active:
            return
        self.active = False
        for hook in reversed(self._hooks):
            hook.remove()
        self._hooks.clear()
        train_function.remove_check(self.model, "numerics")
        if vars(self.model).get(_ATTR) is self:
            object.__delattr__(self.model, _ATTR)
        self.model.train_function = None

    def __enter__(self) -> "NumericsHandle":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()

    def _wrap_call(self, layer: keras.layers.Layer, path: str, original: Callable) -> Callable:
        params = list(inspect.signature(original).parameters)
        first = params[0] if params else None

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            trace = _active_trace(self)
            if trace is None:
                return original(*args, **kwargs)
            before = {id(term) for term in loss_terms.own_terms(layer)}
            inputs = args[0] if args else kwargs.get(first)
            if self.phase == "forward":
                outputs = original(*args, **kwargs)
            else:
                boundary = Boundary(path, type(layer).__name__, layer.compute_dtype, trainable_ids(layer))
                trace.boundaries.append(boundary)
                outputs = call_with_probes(original, args, kwargs, first, boundary, trace.graph)
                boundary.end, trace.ended = trace.ended, trace.ended + 1
            trace.added_in_call.update(id(term) for term in loss_terms.own_terms(layer) if id(term) not in before)
            if self.phase != "backward":
                row = entry_row(outputs, inputs)
                if row is not None:
                    trace.entries.append((path, type(layer).__name__, layer.compute_dtype, row, None))
            return outputs

        return call

    def _wrap_train_step(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def train_step(data: Any) -> Any:
            self._hook_optimizer()
            trace = StepTrace(graph=tf.compat.v1.get_default_graph(), owner=self)
            outer, _local.trace = getattr(_local, "trace", None), trace
            watch = loss_terms.watch(functools.partial(self._record_terms, trace))
            try:
                logs = original(data)
            finally:
                _local.trace = outer
                watch.remove()
            flag = self.recorder.finish(trace)
            if isinstance(logs, dict):
                logs = {**logs, _FLAG: flag}
            return logs

        return train_step

    def _record_terms(self, trace: StepTrace, layer: Any, terms: list) -> None:
        """The first read of the model's `losses` in the step: one trace row per term."""
        if layer is not self.model or trace.terms_read or _active_trace(self) is not trace:
            return
        trace.terms_read = True
        holders = {id(held): (path, type(held).__name__) for held, path in layer_paths(self.model)}
        owners = self._owners()

        def where(obj: Any) -> tuple:
            if obj is self.model:
                return None, type(obj).__name__
            return owners.get(id(obj)) or holders.get(id(obj), (getattr(obj, "name", None), type(obj).__name__))

        checked = {id(checked_layer) for checked_layer in self.layers}
        trace.entries.extend(term_entries(self.model, terms, trace.added_in_call, checked, where))

    def _check_logs(self, logs: Any) -> Any:
        """After a step: takes the flag out of the logs and reports a recorded failure."""
        flag = logs.pop(_FLAG, None) if isinstance(logs, dict) else None
        if flag is None or int(flag):
            self.check()
        return logs

    def _hook_optimizer(self) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or any(optimizer is seen for seen in self._hooked_optimizers):
            return
        self._hooked_optimizers.append(optimizer)

        def wrap_scale_loss(scale_loss: Callable) -> Callable:
            @functools.wraps(scale_loss)
            def checked_scale_loss(loss: Any) -> Any:
                trace = _active_trace(self)
                row = entry_row(loss) if trace is not None else None
                if row is not None:
                    trace.entries.append((LOSS_ENTRY, "loss", tf.as_dtype(loss.dtype).name, row, None))
                return scale_loss(loss)

            return checked_scale_loss

        def wrap_apply(apply: Callable) -> Callable:
            @functools.wraps(apply)
            def checked_apply(grads: Any, trainable_variables: Any = None) -> Any:
                trace = _active_trace(self)
                if trace is not None and self.phase != "forward":
                    grads = list(grads)
                    if trainable_variables is None:
                        trainable_variables = optimizer_variables(optimizer)
                    variables = list(trainable_variables)
                    trace.gradients.append((grads, variables, *scale_and_counts(optimizer)))
                return apply(grads, trainable_variables)

            return checked_apply

        self._hook(optimizer, "scale_loss", wrap_scale_loss)
        self._hook(optimizer, "apply", wrap_apply)

    def _owners(self) -> dict:
        """`id(variable)` -> (path, class) of the deepest layer holding it."""
        owners: dict = {}
        for layer, path in layer_paths(self.model):
            for variable in layer.weights:
                held = owners.get(id(variable))
                if held is None or len(path) > len(held[0]):
                    owners[id(variable)] = (path, type(layer).__name__)
        return owners

    def check(self) -> None:
        """Reads the failure recorded by a step and acts on it, then clears it (the next comes afresh).

        Raises:
            tfmp.NonFiniteError: With `action="raise"`, on the first recorded failure.
        """
        if not self.recorder.failed():
            return
        scaling = scales_loss(getattr(self.model, "optimizer", None))
        error = build_error(self.recorder, self._owners(), scaling,
                            functools.partial(reduction_hint, self.model), self.model.name)
        if error is None:
            return
        if len(self.failures) < _MAX_FAILURES:
            self.failures.append(error)
        self.recorder.rearm()  # reported once; a later failure is recorded afresh
        if self.action == "raise":
            raise error
        key = (error.layer, error.phase, error.kind)
        if key in self._reported:
            return
        self._reported.add(key)
        if self.action == "warn":
            warn_error(error, RuntimeWarning)
        else:
            logger.warning("%s", error)


def check_numerics(
    model: keras.Model,
    *,
    action: str = "raise",
    phase: str = "both",
    layers: LayerSpec = None,
    trace_length: int = 8,
    enabled: bool = True,
) -> Optional[NumericsHandle]:
    """Instruments `model` so training stops at the first non-finite value, naming its layer.

    Works before or after `compile` (the next `fit` or `train_on_batch` rebuilds the train
    function); calling it again replaces the previous hooks; values, losses and weights are
    unchanged. Under a `tf.distribute` strategy, steps are counted once per global step and
    the earliest failure of the step over all replicas is reported once, with that replica's
    trace (one all-reduce per step of `replicas * 6 * (trace_length + 1)` float32).

    Args:
        model: `keras.Model`. The model to instrument.
        action: String. `"raise"` (default) raises `tfmp.NonFiniteError` after the
            step; `"warn"` issues a RuntimeWarning and `"log"` logs to the `"tfmp"`
            logger, once per (layer, phase, kind), and training goes on.
        phase: String. `"forward"` checks layer outputs, the terms of
            `model.losses` and the loss; `"backward"` the terms, the loss and the
            gradients at each checked layer call's outputs, inputs and weights, so
            that the layer whose backward pass turned a finite gradient into NaN
            or inf is named (`error.layer`); `"both"` (default) all of them.
        layers: Which layers to check: None (every layer that computes
            something), a sequence of layer names, paths, Layer classes or Layer
            instances, or a callable `layer -> bool`.
        trace_length: Int in [1, 1024]. Layer calls before the failure whose |value|
            range is attached to the error (`error.details["trace"]`). Default 8.
            Allocates two float32 `[trace_length, 6]` variables.
        enabled: Bool. False removes hooks installed earlier and returns None.

    Returns:
        `NumericsHandle` (call `.remove()` or use it as a context manager), or None
        when `enabled` is False.

    Raises:
        ValueError: (template, naming the argument) `model` is not a
            `keras.Model` or has no layer (an unbuilt model with layers is
            fine); `action` or `phase` is not one of its choices; `layers` is
            not None, a callable, or a layer name, path, class or instance or a
            non-empty list of them, or names no layer of `model`;
            `trace_length` is not an int in [1, 1024]; `enabled` is not a bool.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile("sgd", "mse")
        >>> handle = check_numerics(model)
        >>> handle.remove()
    """
    check_model("model", model, expected="a keras.Model instance", fix=_MODEL_FIX)
    check_options(action, phase, layers, trace_length)
    check_bool("enabled", enabled)
    previous = vars(model).get(_ATTR)
    if previous is not None:
        previous.remove()
    if not enabled:
        return None
    handle = NumericsHandle(model, action, phase, layers, trace_length)
    handle._install()
    return handle
