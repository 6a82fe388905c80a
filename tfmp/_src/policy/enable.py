"""`tfmp.enable()`, `tfmp.disable()` and `tfmp.policy_scope()`: the session and its compile handler.

While the calling thread has a session (`tfmp._src.policy.session`), every model
compiled or loaded in it is attached (`tfmp._src.attachment`): float32 forcing, a
loss-scale optimizer, exact token ids, explained dtype errors, optionally
`tfmp.check_numerics`. The class-level hooks into Keras are on while some thread has one.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import weakref
from typing import Any, Callable, Iterator, List, Optional, Union

import keras
import tensorflow as tf

from tfmp._src.attachment import compile_line
from tfmp._src.attachment import hooks as attachment_hooks
from tfmp._src.attachment.attach import attach, optimizer_decision
from tfmp._src.attachment.record import Attachment
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.distribute import prepare_multi_worker, turn_off_xla_if_replicated
from tfmp._src.errors import check_bool, warn
from tfmp._src.keras_hooks import fit_lifecycle, surfaces, trainer
from tfmp._src.deployment.quantize_hint import explain_quantize
from tfmp._src.float32 import build_errors, exact_layers, loaded_layers
from tfmp._src.deployment import tflite_hint
from tfmp._src.float32.dtype_errors import explain_dtype_errors
from tfmp._src.float32.xla_bilinear import turn_off_xla_for_bilinear
from tfmp._src.float32.force import force_compiled, force_loaded
from tfmp._src.float32.master_weights import warn_16bit_trainable
from tfmp._src.float32.token_ids import exact_id_embeddings, keep_exact_ids
from tfmp._src.policy.hardware import DeviceFacts, detect_device_facts
from tfmp._src.layer_tree import layers_compute_dtype, walk
from tfmp._src.loss_scale import loops
from tfmp._src.loss_scale import custom_optimizers
from tfmp._src.loss_scale import user_settings
from tfmp._src.loss_scale.optimizer import LossScaleOptimizer, check_wrap_options, wrap_optimizer
from tfmp._src.numerics.check import check_numerics
from tfmp._src.policy import session
from tfmp._src.policy.enable_options import check_debug, checked_loss_scale_options
from tfmp._src.policy.policy import PerformanceWarning, PolicyDecision, resolve_policy, slower_than_float32
from tfmp._src.policy.session import Session
from tfmp._src.policy.speedups import checked_speedups, off
from tfmp._src.float32.registry import targets_from

_session_hooks: List[trainer.Hook] = []
#: The session hooks besides compile's, each an optional feature (`keras_hooks.availability`).
_OPTIONAL_SESSION_HOOKS = (
    ("first_step", lambda: trainer.install_make_train_function_hook(
        _warn_if_compiled_before_enable, owner="enable.first_step")),
    ("loaded_layers", loaded_layers.install),
    ("exact_layers", exact_layers.install),
    ("build_errors", build_errors.install),
    ("tflite_hint", tflite_hint.install),
)


class _SessionsOpen:
    """Stands for "a thread has a session" among what needs the fit hook."""


_SESSIONS_OPEN = _SessionsOpen()
_warned_compiled_before: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _set_current(state: Optional[Session]) -> None:
    """Makes `state` this thread's session; installs the session hooks for the first, removes them after the
    last. Raises what installing a hook raises, this thread's session then as before."""
    speed = attachment_hooks.speed_features(state.speedups) if state else frozenset()
    with session.lock:
        before = session.replace(state)
        if not session.any_open():
            while _session_hooks:
                _session_hooks[-1].remove()  # kept in the list if removing raises
                _session_hooks.pop()
            fit_lifecycle.not_needed_by(_SESSIONS_OPEN)
            _release_unused_hooks()
            return
        try:
            installed = []
            if not _session_hooks:
                installed = surfaces.all_or_none([
                    lambda: trainer.install_compile_hook(
                        _compile_with_tfmp, keep_saved=is_enabled, on_load=_attach_loaded),
                ])
                for feature, install in _OPTIONAL_SESSION_HOOKS:  # each off alone where Keras moved it
                    installed += surfaces.optional(feature, install)
            try:
                attachment_hooks.hold(speed)  # back on if a detach took them off
                fit_lifecycle.needs(_SESSIONS_OPEN)  # the error out of fit reaches monitors
            except BaseException:
                for hook in reversed(installed):
                    hook.remove()
                raise
            _session_hooks.extend(installed)
        except BaseException:
            session.replace(before)
            raise


def _release_unused_hooks() -> None:
    loops.release_if_unused()
    fit_lifecycle.release_if_unused()
    attachment_hooks.release_if_unused()


def is_enabled() -> bool:
    """Bool. True in this thread between `tfmp.enable()` and `tfmp.disable()`."""
    return session.current() is not None


def current_decision() -> Optional[PolicyDecision]:
    """The `PolicyDecision` in force in this thread, or None when tfmp is not enabled."""
    state = session.current()
    return state.decision if state else None


def enable(
    policy: Union[str, keras.DTypePolicy] = "auto",
    *,
    keep_float32: Any = (),
    exclude_float32: Any = (),
    loss_scale_options: Optional[dict] = None,
    allow_pure_16bit: bool = False,
    tf32: Optional[bool] = None,
    debug: Union[bool, dict] = False,
    device_facts: Optional[DeviceFacts] = None,
    speedups: Union[bool, dict] = True,
    verbose: bool = True,
) -> PolicyDecision:
    """Sets the Keras global dtype policy and makes every model compiled use tfmp.

    Call it before building the model: layers take the global policy when they are
    created. Like Keras's global policy, it applies to the calling thread. Called
    again, the same policy changes only the options; another replaces it with a
    `UserWarning` (models compiled before keep theirs; `disable()` still restores
    the policy in force before the first call).

    Models compiled while enabled get float32 forcing; a `tfmp.LossScaleOptimizer`
    in float16 or bfloat16, or in float32 when `debug` or `loss_scale_options` ask;
    and, with `debug`, `tfmp.check_numerics`. A loaded model comes back as saved.
    Training a model compiled before `enable()` warns at its first step.

    Args:
        policy: String or `keras.DTypePolicy`. ``"auto"`` (default) picks by
            hardware (see `tfmp.recommend_policy`); or ``"mixed_float16"``,
            ``"mixed_bfloat16"``, ``"float32"``.
        keep_float32: A layer class or layer-path glob pattern (e.g.
            ``"encoder/*_norm"``), or a sequence of them, to keep in float32 besides
            tfmp's defaults (outputs, softmax, normalization).
        exclude_float32: Same form: layers tfmp must not force.
        loss_scale_options: Dict or None. Keyword arguments for
            `tfmp.LossScaleOptimizer` (e.g. ``{"initial_scale": 2.0**15}``); its
            ``guard`` defaults to every gradient under float16, else ``"batch"``.
        allow_pure_16bit: Bool. Accept ``"float16"``/``"bfloat16"`` policies, which
            keep no float32 master weights. Default False.
        tf32: Bool or None. Switch TF32 matmuls on or off on GPUs of compute
            capability 8.0 or more; None leaves TensorFlow's setting (on by default).
            The setting is process-wide until `disable()` puts it back.
        debug: Bool or dict. True instruments every model compiled while enabled
            with `tfmp.check_numerics` (first non-finite layer raises
            `tfmp.NonFiniteError`); a dict gives its keyword options, e.g.
            ``{"action": "warn"}``. Default False. Also sets
            ``guard="gradients"`` unless `loss_scale_options` set a guard.
        device_facts: `tfmp.DeviceFacts` or None. Device facts to decide "auto"
            for; None reads this machine's.
        speedups: Bool or dict of feature name -> bool. tfmp's speed features
            (``"fused_batchnorm"``, ``"gelu"``, ``"conv"``, ``"cross_entropy"``, ``"remapper"``,
            ``"fused_update"``) for the models compiled from now on: True
            (default) on CPUs, where they were measured (a GPU or TPU keeps
            Keras's paths), False none; a dict turns the named ones on or off.
            Each model keeps what it was compiled or loaded with
            (`tfmp.attachment(model).speedups`; a saved file does not keep it).
        verbose: Bool. True (default): each ``compile`` prints one line to stdout
            saying what tfmp did (policy, layers forced to float32 and why,
            optimizer), again only when it changed. False prints nothing.

    Returns:
        `PolicyDecision`: `.policy` (Keras policy name) and `.reason`.

    Raises:
        ValueError: (template, naming the argument; nothing changes) an unknown
            or unsafe policy; `keep_float32`/`exclude_float32` not a Layer class,
            a non-empty pattern or a list, tuple or set of those (None included:
            pass ``()`` for none); `loss_scale_options` not a dict or None, with
            an unknown key or a value `tfmp.LossScaleOptimizer` refuses;
            `allow_pure_16bit` not a bool; `tf32` neither None nor a bool;
            `debug` neither a bool nor a dict of `tfmp.check_numerics` options
            with values it accepts (an unknown ``action`` is named as `action`);
            `device_facts` neither None nor a `tfmp.DeviceFacts`; `speedups`
            neither a bool nor a dict of known feature names -> bool; `verbose`
            not a bool.

    Warns:
        tfmp.PerformanceWarning: an explicit policy slower than float32 here.
        UserWarning: this thread is already enabled with another policy, which
            this call replaces (the old and new policy and the fix).
        tfmp.LossScaleWarning: `loss_scale_options` set scaling settings
            (``initial_scale``, ``dynamic_growth_steps``, ``min_scale``, ``max_scale``,
            ``hysteresis``) without ``loss_scaling`` under a bfloat16 or float32 policy.
        tfmp.UnmatchedTargetWarning: later, at ``compile()``: a `keep_float32`
            or `exclude_float32` target matches no layer of the model compiled
            (once per model and target; see `tfmp.force_float32`).
    """
    return _start(True, policy, keep_float32, exclude_float32, loss_scale_options, allow_pure_16bit, tf32,
                  debug, device_facts, speedups, verbose)


def _start(say_replaced: bool, policy: Union[str, keras.DTypePolicy], keep_float32: Any, exclude_float32: Any,
           loss_scale_options: Optional[dict], allow_pure_16bit: bool, tf32: Optional[bool],
           debug: Union[bool, dict], device_facts: Optional[DeviceFacts], speedups: Union[bool, dict],
           verbose: bool) -> PolicyDecision:
    """`enable()` itself; `say_replaced` is False for `policy_scope`, which nests by design."""
    # Every argument is checked before any state changes.
    check_bool("tf32", tf32, allow_none=True)
    check_bool("verbose", verbose)
    keep_float32 = targets_from("keep_float32", keep_float32)
    exclude_float32 = targets_from("exclude_float32", exclude_float32)
    check_debug(debug)
    wanted_speedups = checked_speedups(speedups)
    loss_scale_options = checked_loss_scale_options(loss_scale_options)  # before the policy's warnings
    decision = resolve_policy(policy, allow_pure_16bit=allow_pure_16bit, device_facts=device_facts)
    check_wrap_options(decision.compute_dtype, **loss_scale_options)
    state = session.current()
    if say_replaced and state is not None and state.decision.policy != decision.policy:
        _warn_replaced(state, decision)
    user_settings.warn_unused_scaling_options(loss_scale_options, decision.policy, decision.compute_dtype)
    previous = state.previous_policy if state else keras.config.dtype_policy()
    previous_tf32 = state.previous_tf32 if state else None
    if tf32 is not None and previous_tf32 is None:
        previous_tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    _set_current(Session(decision, previous, previous_tf32, keep_float32, exclude_float32, loss_scale_options,
                         debug, wanted_speedups, verbose, scoped=not say_replaced))
    if tf32 is not None:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
    keras.config.set_dtype_policy(decision.policy)
    return decision


def _warn_replaced(state: Session, decision: PolicyDecision) -> None:
    """Warns that a second `enable()` replaces this thread's policy by another."""
    old, new = state.decision.policy, decision.policy
    if state.scoped:
        warn(f"tfmp.enable({new!r}) replaces the policy {old!r} of the enclosing tfmp.policy_scope() until it ends.",
             f"Models compiled before keep {old!r}; the scope's end puts back what was in force before it.",
             f"Fix: nest `with tfmp.policy_scope({new!r}):` instead, or call tfmp.enable() outside the scope.",
             UserWarning, section="policy-and-build-order")
        return
    warn(f"tfmp.enable({new!r}) replaces the policy {old!r} of the earlier tfmp.enable() in this thread.",
         f"Models compiled before keep {old!r}; tfmp.disable() still restores {state.previous_policy.name!r}.",
         f"Fix: call tfmp.disable() first, or for a block use `with tfmp.policy_scope({new!r}):`.",
         UserWarning, section="policy-and-build-order")


def disable() -> None:
    """Ends this thread's session: restores the policy in force before `enable()`.

    Models tfmp attached keep what it decided for them (`tfmp.attachment`);
    `tfmp.detach(model)` takes that off one model. Models compiled from now on in
    this thread are plain Keras. tfmp's hooks into Keras come off once no live
    thread is enabled (an attached model puts its own back while it computes), so
    a model tfmp did not attach then runs no tfmp code.
    """
    state = session.current()
    _set_current(None)  # also forgets threads that ended while enabled
    if state is None:
        _release_unused_hooks()
        return
    if state.previous_tf32 is not None:
        tf.config.experimental.enable_tensor_float_32_execution(state.previous_tf32)
    keras.config.set_dtype_policy(state.previous_policy)


@contextlib.contextmanager
def policy_scope(policy: Union[str, keras.DTypePolicy] = "auto", **options: Any) -> Iterator[PolicyDecision]:
    """Context-manager form of `enable()`; restores the previous state on exit.

    The previous global policy (and any enclosing `enable()` with its options) is
    back on exit, also when the block raises; it does not warn inside `enable()`.

    Args:
        policy: As for `enable()`.
        **options: Keyword options of `enable()`.

    Yields:
        `PolicyDecision` in force inside the block.

    Raises:
        TypeError: on entering the block, an option `enable()` does not take
            (Python's message, as `enable()` itself gives it).
        ValueError: (template) on entering the block, before any state
            changes: any value `enable()` refuses.
    """
    saved_state = session.current()
    saved_policy = keras.config.dtype_policy()
    saved_tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    arguments = inspect.signature(enable).bind(policy, **options)  # TypeError for an unknown option
    arguments.apply_defaults()
    try:
        yield _start(False, **arguments.arguments)
    finally:
        _set_current(saved_state)
        tf.config.experimental.enable_tensor_float_32_execution(saved_tf32)
        keras.config.set_dtype_policy(saved_policy)


def _warn_if_built_before_enable(model: keras.Model, policy: str) -> None:
    """Warns when `model` took another policy than tfmp's (built earlier), saying what its layers compute in."""
    if model.dtype_policy.name != policy:
        counts = collections.Counter(entry.layer.compute_dtype for entry in walk(model))
        layers = ", ".join(f"{dtype} ({n})" for dtype, n in counts.most_common())
        now = keras.config.dtype_policy().name
        if now != policy:
            cause = f"The global policy was changed to {now!r} after tfmp.enable() (keras.config.set_dtype_policy)."
            fix = f"Fix: leave the global policy to tfmp, or call tfmp.enable({now!r}) instead."
        else:
            cause = "Layers take the global policy when they are created, and these were created before."
            fix = "Fix: build the model after tfmp.enable()."
        warn(f"Model {model.name!r} was built under {model.dtype_policy.name!r}, not tfmp's {policy!r}: "
             f"its layers compute in {layers or model.dtype_policy.compute_dtype}.",
             cause, fix, PerformanceWarning, section="policy-and-build-order")


def _warn_if_compiled_before_enable(model: keras.Model) -> None:
    """At `fit`: warns once when `model` was compiled without tfmp while tfmp is on."""
    state = session.current()
    if (state is None or state.decision.policy == "float32" or trainer.compiled_by_tfmp(model)
            or trainer.restored_by_keras(model) or model in _warned_compiled_before):
        return
    _warned_compiled_before.add(model)
    optimizer = getattr(model, "optimizer", None)
    warn(f"Model {model.name!r} was compiled before tfmp.enable(): it trains without tfmp.",
         f"It has policy {model.dtype_policy.name!r}, optimizer {type(optimizer).__name__}, no float32 forcing; "
         f"tfmp's is {state.decision.policy!r}.",
         "Fix: build and compile the model after tfmp.enable().",
         PerformanceWarning, section="policy-and-build-order")


def _fix_and_attach(model: keras.Model, state: Session, attached_by: str, optimizer: Any = None) -> Attachment:
    """Exact token ids and dtype-error explanations, then the model's `Attachment` (`optimizer`: the one a
    loaded model is about to be compiled with)."""
    keep_exact_ids(model)
    optimizer = getattr(model, "optimizer", None) if optimizer is None else optimizer
    warn_16bit_trainable(model, master_copies=isinstance(optimizer, LossScaleOptimizer))
    prepare_multi_worker(model)
    compute_dtype = layers_compute_dtype(model)
    explains = compute_dtype in LOW_PRECISION
    if explains:
        explain_dtype_errors(model)
    if compute_dtype == "float16":
        explain_quantize(model)
    saved = saved_policy(model)
    found = attach(model, saved or state.decision.policy, attached_by=attached_by,
                   exact_ids=exact_id_embeddings(model), explains_dtype_errors=explains,
                   numerics=bool(state.debug) and attached_by == "compile", speedups=state.speedups)
    if isinstance(getattr(model, "optimizer", None), LossScaleOptimizer) and off("fused_update", found.speedups):
        model.optimizer.fused_updates = False  # made before this session, or loaded: the model's switch
    found.optimizer = optimizer_decision(getattr(model, "optimizer", None), attached_by)
    return found


def _attach_loaded(model: keras.Model, loss: Any = None, optimizer: Any = None) -> None:
    """While enabled, puts tfmp's per-model changes (not kept by saving) back on a model Keras loads, as saved."""
    state = session.current()
    if state is not None:
        force_loaded(model, keep=state.keep_float32, exclude=state.exclude_float32, loss=loss)
        found = _fix_and_attach(model, state, "load", optimizer)
        if found.policy != state.decision.policy:
            _warn_loaded_under_another_policy(model, found.policy, state.decision.policy)


def saved_policy(model: keras.Model) -> Optional[str]:
    """The one mixed or 16-bit policy `model`'s layers were saved with, or None (float32, or several)."""
    names = {entry.layer.dtype_policy.name for entry in walk(model)} - {"float32"}
    return names.pop() if len(names) == 1 else None


def _warn_loaded_under_another_policy(model: keras.Model, saved: str, policy: str) -> None:
    """Says once that a loaded model trains under the policy it was saved with, not the session's (and
    when that policy is slower than float32 on this machine, as `tfmp.enable` would say of it)."""
    cause = "Its layers keep the policies saved with them (tfmp.attachment(model).policy says so)."
    if slower_than_float32(saved, detect_device_facts()):
        cause = f"Its layers keep the policies saved with them, and {saved!r} is slower than float32 on this machine."
    warn(f"Model {model.name!r} was saved under {saved!r} and trains so, not under this session's {policy!r}.",
         cause,
         f"Fix: build it anew after tfmp.enable({policy!r}) and copy the weights (set_weights).",
         UserWarning, section="policy-and-build-order")


def _compile_with_tfmp(compile: Callable, model: keras.Model, args: tuple, kwargs: dict) -> Any:
    """tfmp's compile handler: force float32 where needed, wrap the optimizer(s), turn off XLA it cannot run, attach."""
    state = session.current()
    if state is None:
        return compile(model, *args, **kwargs)
    args = list(args)
    optimizer = args.pop(0) if args else kwargs.pop("optimizer", "rmsprop")
    _warn_if_built_before_enable(model, state.decision.policy)
    loss = args[0] if args else kwargs.get("loss")
    force_compiled(model, keep=state.keep_float32, exclude=state.exclude_float32, loss=loss)
    wrap_options = None
    compute_dtype = layers_compute_dtype(model)
    # Under float32 the optimizer stays the user's unless debug or options ask.
    if compute_dtype in LOW_PRECISION or state.debug or state.loss_scale_options:
        wrap_options = {"guard": "gradients", **state.loss_scale_options} if state.debug else state.loss_scale_options
    if optimizer is not None and wrap_options is not None:
        optimizer = wrap_optimizer(optimizer, compute_dtype, **wrap_options)
    result = compile(model, optimizer, *args, **kwargs)
    trainer.mark_compiled_by_tfmp(model)
    turn_off_xla_if_replicated(model) or turn_off_xla_for_bilinear(model)
    if state.debug:
        options = {} if state.debug is True else state.debug
        check_numerics(model, **options)
    found = _fix_and_attach(model, state, "compile")
    custom_optimizers.adopt(model, compute_dtype, wrap_options)  # a custom compile's own
    if state.verbose:
        compile_line.say(model, found)
    return result
