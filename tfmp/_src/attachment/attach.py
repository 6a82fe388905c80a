"""Attaching a model to tfmp, reading what was decided (`tfmp.attachment`), and `tfmp.detach`.

`attach` runs when a model is compiled or loaded while tfmp is enabled: the decisions made then
are recorded in one `Attachment` carried by the model and every layer in it. After
`tfmp.disable()` a model keeps exactly that: its attachment, its layers' policies, its optimizer.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, FrozenSet, Iterator, List, Optional

import keras

from tfmp._src.attachment import hooks, record
from tfmp._src.attachment.record import Attachment
from tfmp._src.errors import invalid_argument
from tfmp._src.float32 import (activity_regularizers, bias_gradient, conv, cross_entropy, dropout_draw,
                               fused_batchnorm, gelu)
from tfmp._src.float32.force import forced_reason
from tfmp._src.keras_hooks import multi_worker, surfaces, train_function
from tfmp._src.keras_hooks import step_scope as model_scopes
from tfmp._src.layer_tree import layers_compute_dtype, walk
from tfmp._src.loss_scale import custom_optimizers, loops
from tfmp._src.numerics.check import check_numerics
from tfmp._src.policy import float16_fusion
from tfmp._src.policy import speedups as speedup_rules

#: The name of the step scope of a model run without Grappler's remapper.
REMAPPER_OFF = "remapper off"
#: Subscribers `detach` leaves on: float32 forcing's, which make the saved layer policies compute as they say.
KEPT_OWNERS = ("float32.build", "float32.outputs", "float32.cast_back")


def _check_model(model: Any, function: str) -> None:
    if not isinstance(model, keras.layers.Layer):
        raise invalid_argument(
            "model", model, "a keras.Model or one of its layers",
            fix=f"Pass the model itself, e.g. tfmp.{function}(model).",
        )


@contextlib.contextmanager
def _tracing_step(model: keras.Model, features: FrozenSet[str]) -> Iterator[None]:
    """The scope `model`'s steps are traced in: the model-level hooks on, `model` the stepping one."""
    with hooks.in_step(features), record.stepping(model):
        yield


def attach(model: keras.Model, policy: str, *, attached_by: str, exact_ids: int,
           explains_dtype_errors: bool, numerics: bool,
           speedups: Optional[Dict[str, bool]] = None) -> Attachment:
    """Records what tfmp decided for `model` (already forced and hooked) and marks it and its layers.

    `attached_by` is ``"compile"`` or ``"load"``; `speedups` the session's (None: all). Returns the
    `Attachment`, replacing any earlier one; what installing the step hooks raises leaves nothing marked.
    """
    features = hooks.speed_features(speedups)
    if isinstance(model, keras.Model):  # the model-level hooks while Keras traces its steps
        model_scopes.trace_in(model, lambda: _tracing_step(model, features))
        loops.serve(model)  # the stuck check, batch record and saved form on the model itself
    speeds = speedup_rules.decided(speedups)
    entries = walk(model)
    compute_dtype = layers_compute_dtype(model, entries)
    remapper = _remapper_decision(model, compute_dtype, allowed=speeds["remapper"] == speedup_rules.ON)

    def inside(feature: str, decision: Any) -> str:  # the switch, else the feature's own rule
        switched = speeds[feature] == speedup_rules.OFF_BY_SWITCH
        return speedup_rules.KERAS_BY_SWITCH if switched else decision(compute_dtype)

    found = Attachment(
        model=model.name, attached_by=attached_by, policy=policy,
        layer_policies={e.path: e.layer.dtype_policy.name for e in entries},
        forced_float32={e.path: why for e in entries if (why := forced_reason(e.layer))},
        exact_ids=exact_ids, explains_dtype_errors=explains_dtype_errors, check_numerics=numerics,
        remapper=remapper, bias_gradient=bias_gradient.decision(compute_dtype),
        gelu=inside("gelu", gelu.decision), conv=inside("conv", conv.decision),
        depthwise_conv=inside("conv", conv.depthwise_decision),
        dropout=dropout_draw.decision(compute_dtype),
        cross_entropy=inside("cross_entropy", cross_entropy.decision),
        speedups=speeds,
        activity_regularizers_in_float32=sorted(
            e.path for e in entries if activity_regularizers.regularize_in_float32(e.layer)),
    )
    record.mark([model, *(e.layer for e in entries)], found)
    hooks.hold_in_calls([model, *(e.layer for e in entries)], features)
    found.batchnorm_kernel = {
        e.path: fused_batchnorm.audit_note(e.layer)
        for e in entries if isinstance(e.layer, keras.layers.BatchNormalization)
    }
    return found


def _remapper_decision(model: Any, compute_dtype: str, *, allowed: bool) -> str:
    """Runs `model`'s functions without Grappler's remapper where `float16_fusion.remapper_trap` says so
    for its layers' `compute_dtype`.

    Any other model, or one whose switch is off (`allowed` False), has no scope. Returns
    ``Attachment.remapper``: ``"on"`` or ``"off: <why>"``.
    """
    trap = None
    if isinstance(model, keras.Model) and allowed:
        trap = float16_fusion.remapper_trap(compute_dtype)
    if trap is None:
        model_scopes.remove(model)
        return "on"
    model_scopes.install(model, float16_fusion.remapper_off, name=REMAPPER_OFF)
    return f"off: {trap}"


def _attached_models_holding(layer: Any) -> list:
    """The live attached models, other than `layer`, that have `layer` among their layers."""
    return [obj for obj in record.marked_objects()
            if isinstance(obj, keras.Model) and obj is not layer
            and any(entry.layer is layer for entry in walk(obj))]


def attachment(model: keras.layers.Layer) -> Optional[Attachment]:
    """What tfmp decided for `model` when it attached it, or None.

    Args:
        model: `keras.Model`, or a layer of one (it carries its model's attachment, or its own
            when attached at its first call).

    Returns:
        `tfmp.Attachment`, or None for a model tfmp did not attach (compiled without tfmp
        enabled in its thread, or detached).

    Raises:
        ValueError: `model` is not a Keras model or layer.
    """
    _check_model(model, "attachment")
    found = record.of(model)
    if found is not None:
        found.subscriptions = subscriptions(model)
        if found.attached_by == "load":  # attached before Keras compiled it: the optimizer it has now
            found.optimizer = optimizer_decision(getattr(model, "optimizer", None), "load")
    return found


def optimizer_decision(optimizer: Any, attached_by: str) -> str:
    """The `Attachment.optimizer` text: what tfmp did with `optimizer` (see `Attachment`)."""
    if optimizer is None:
        return ""
    inner = getattr(optimizer, "inner_optimizer", None)
    if type(optimizer).__module__.split(".")[0] == "tfmp" and inner is not None:  # a tfmp.LossScaleOptimizer
        scaling = "dynamic loss scale" if optimizer.loss_scaling else "no loss scaling"
        fused = "on" if optimizer.fused_updates else "off"
        return (f"tfmp.LossScaleOptimizer({type(inner).__name__}): {scaling}, "
                f"guard={optimizer.guard!r}, fused updates {fused}")
    name = type(optimizer).__name__
    return f"{name}: as saved" if attached_by == "load" else f"{name}: kept (float32 compute)"


def subscriptions(model: keras.layers.Layer) -> Dict[str, List[str]]:
    """`Attachment.subscriptions`: what tfmp hooks on `model`, its layers, their policies and its optimizer now.

    ``"model"`` also lists the checks after each train step (``"trainer: train step check <name>"``).
    """
    objects = [("model", model)]
    for entry in walk(model):
        objects += [(entry.path, entry.layer), (f"{entry.path}.dtype_policy", entry.layer.dtype_policy)]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        objects.append(("optimizer", optimizer))
    found: Dict[str, List[str]] = {}
    for name, obj in objects:
        rows = [f"{hook.surface.name}: {hook.name} ({hook.owner})" for hook in surfaces.subscriptions_on(obj)]
        if obj is model:
            rows += [f"trainer: train step check {check}" for check in train_function.CHECK_ORDER
                     if train_function.has_check(model, check)]
        if rows:
            found[name] = rows
    return found


def detach(model: keras.layers.Layer) -> Optional[Attachment]:
    """Gives `model` back to Keras: its next `fit` traces plain Keras code.

    Takes off, for good, the attachment of the model and its layers (so the fused BatchNormalization
    kernel, the float32-inside GELU and convolutions and the float32 loss-term casts no longer apply),
    every hook tfmp put on them but float32 forcing's (`KEPT_OWNERS`): `tfmp.check_numerics`, the
    train-step checks, the hooks on optimizers stored on the model, the exact-token-id, dtype-error
    and quantize hooks, the float16 step scope; and every ``_tfmp_*`` attribute. The train, test and
    predict functions of the model, and of any attached model holding it, are reset (traced again).
    Kept, as Keras state: the layers' dtype policies and ``model.optimizer``. A
    `tfmp.LossScaleOptimizer` still skips non-finite steps, but `fit` no longer stops a stuck run:
    call ``model.optimizer.raise_if_stuck()`` in a callback, or compile again under tfmp.

    Args:
        model: `keras.Model` (or a layer: it and its sublayers). A model that is
            not attached is left as it is.

    Returns:
        The `tfmp.Attachment` the model had, or None.

    Raises:
        ValueError: `model` is not a Keras model or layer.
    """
    _check_model(model, "detach")
    found = record.of(model)
    objects = [model, *(e.layer for e in walk(model))]
    if isinstance(model, keras.Model):
        check_numerics(model, enabled=False)
        model_scopes.remove(model)
        model_scopes.untrace(model)
        multi_worker.remove(model)
        loops.forget(model)
        custom_optimizers.forget(model)
        train_function.remove_all(model)
    for holder in [model, *_attached_models_holding(model)]:  # traced with the detached part
        if isinstance(holder, keras.Model):
            holder.train_function = holder.test_function = holder.predict_function = None
    for layer in objects:
        activity_regularizers.regularize_as_keras(layer)
    for obj in objects + [obj.dtype_policy for obj in objects]:
        for hook in surfaces.subscriptions_on(obj):
            if hook.owner not in KEPT_OWNERS:
                hook.remove()
    record.unmark(objects, detached=True)
    hooks.release_if_unused()
    return found


def step_scope(model: keras.Model) -> ContextManager[Optional[str]]:
    """Runs the block's `tf.function` calls with the graph options tfmp chose for `model`'s steps.

    `fit`, `evaluate` and `predict` of an attached model run its steps in that scope; a custom loop's
    own `tf.function`, first called inside this block, gets the same graph, hence the same kernels
    and rounding. Today the one option is Grappler's remapper, off for a ``mixed_float16`` model on a
    CPU where oneDNN's fused float16 matmul crawls (``tfmp.attachment(model).remapper``); it affects
    the calling thread only. The block also keeps tfmp's model-level hooks on, as `fit` does while
    tracing (``model.losses`` summed in float32, backward dtype errors explained once no thread is
    enabled). Also usable as a decorator.

    Args:
        model: `keras.Model`. One compiled under tfmp (attached) gets the options
            tfmp chose for it; a model tfmp did not attach (not compiled, compiled
            without tfmp, or detached) has none: the block runs as it is.

    Returns:
        A context manager (also a decorator) whose ``as`` target is the name of the
        scope entered (``"remapper off"``), or None.

    Raises:
        ValueError: (template, at the call) `model` is not a Keras model.

    Example:
        >>> import keras, tfmp
        >>> with tfmp.policy_scope("float32"):
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="net")
        ...     model.compile("sgd", "mse")
        tfmp: model 'net' compiled under float32; no layer forced to float32; optimizer SGD left alone (float32 compute)
        >>> with tfmp.step_scope(model) as name:
        ...     print(name)  # no scope for a float32 model
        None
    """
    if not isinstance(model, keras.Model):
        raise invalid_argument(
            "model", model, "a keras.Model (one compiled under tfmp gets its step's graph options)",
            fix="Pass the model whose step the block calls, e.g. "
            "`with tfmp.step_scope(model): loss = train_step(x, y)`.",
        )
    return _in_scope(model)


@contextlib.contextmanager
def _in_scope(model: keras.Model) -> Iterator[Optional[str]]:
    with contextlib.ExitStack() as stack:
        for scope in (model_scopes.trace_scope_entry(model), model_scopes.scope_entry(model)):
            if scope is not None:
                stack.enter_context(scope())
        yield model_scopes.scope_of(model)
