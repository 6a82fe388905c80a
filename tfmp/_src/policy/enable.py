"""`tfmp.enable()`, `tfmp.disable()` and `tfmp.policy_scope()`: tfmp's state and its compile handler.

While enabled, every model compiled gets float32 forcing (`tfmp.force_float32`), a
`tfmp.LossScaleOptimizer` when it computes in 16 bits (or when asked) and, with
``debug=True``, `tfmp.check_numerics` hooks, without further calls. The hooks into
Keras (``compile``, ``compile_from_config``, ``make_train_function`` from
`tfmp._src.keras_hooks.model_hooks`; the ``Layer.losses`` property from
`tfmp._src.keras_hooks.loss_terms`, so 16-bit loss terms are summed in float32;
``BatchNormalization.call`` from `tfmp._src.float32.fused_batchnorm`, which traces
TensorFlow's fused kernel while the calling thread is enabled with a mixed policy)
are installed while any thread is enabled;
`disable()` removes them with the last thread, and restores the previous global
policy and the TF32 setting.

Per thread, as Keras: Keras keeps its global dtype policy per thread, so tfmp's
state is per thread too. A model compiled in a thread that did not call
`enable()` is left alone, even while another thread is enabled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import keras
import tensorflow as tf

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.distribute import turn_off_xla_if_replicated
from tfmp._src.errors import check_bool, invalid_argument, unknown_key, user_stacklevel
from tfmp._src.keras_hooks import model_hooks, patches
from tfmp._src.keras_hooks.loss_terms import install_losses_hook
from tfmp._src.float32.dtype_errors import explain_dtype_errors
from tfmp._src.float32 import fused_batchnorm
from tfmp._src.float32.force import force_float32, force_loaded
from tfmp._src.float32.token_ids import keep_exact_ids
from tfmp._src.policy.hardware import DeviceFacts
from tfmp._src.loss_scale import loops
from tfmp._src.loss_scale.optimizer import WRAP_OPTIONS
from tfmp._src.loss_scale.optimizer import wrap_optimizer
from tfmp._src.numerics.check import check_numerics
from tfmp._src.policy.policy import PerformanceWarning, PolicyDecision, resolve_policy
from tfmp._src.float32.registry import targets_from

@dataclasses.dataclass
class _Enabled:
    """What `enable()` changed in one thread, so that `disable()` can put it back."""

    decision: PolicyDecision
    previous_policy: keras.DTypePolicy
    previous_tf32: Optional[bool]
    keep_float32: Sequence[Any]
    exclude_float32: Sequence[Any]
    loss_scale_options: dict
    debug: Union[bool, dict] = False


# thread ident -> (the thread, its state). Python reuses the ident of a thread
# that ended, so an entry counts only for the very thread that made it.
_states: Dict[int, Tuple[threading.Thread, _Enabled]] = {}
_hooks: List[patches.Hook] = []
_lock = threading.RLock()
_warned_compiled_before: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _current() -> Optional[_Enabled]:
    entry = _states.get(threading.get_ident())
    if entry is None or entry[0] is not threading.current_thread():
        return None
    return entry[1]


def _set_current(state: Optional[_Enabled]) -> None:
    """Sets this thread's state; installs or removes the Keras hooks as needed.

    Raises:
        Whatever installing a hook raises; this thread's state is then as before.
    """
    with _lock:
        alive = set(threading.enumerate())
        for ident in [i for i, (thread, _) in _states.items() if thread not in alive]:
            del _states[ident]  # threads that ended while enabled
        ident = threading.get_ident()
        before = _states.get(ident)
        if state is None:
            _states.pop(ident, None)
        else:
            _states[ident] = (threading.current_thread(), state)
        if _states and not _hooks:
            try:
                _hooks.extend(patches.install_all([  # all four or none
                    lambda: model_hooks.install_compile_hook(
                        _compile_with_tfmp, keep_saved=is_enabled, on_load=_force_loaded),
                    lambda: model_hooks.install_make_train_function_hook(
                        _warn_if_compiled_before_enable, owner="enable.first_step"),
                    install_losses_hook,
                    fused_batchnorm.install,
                ]))
            except BaseException:
                if before is None:
                    _states.pop(ident, None)
                else:
                    _states[ident] = before
                raise
        elif not _states:
            while _hooks:
                _hooks[-1].remove()  # kept in the list if removing raises
                _hooks.pop()
            loops.release_if_unused()


def is_enabled() -> bool:
    """Bool. True in this thread between `tfmp.enable()` and `tfmp.disable()`."""
    return _current() is not None


def current_decision() -> Optional[PolicyDecision]:
    """The `PolicyDecision` in force in this thread, or None when tfmp is not enabled."""
    state = _current()
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
) -> PolicyDecision:
    """Sets the Keras global dtype policy and makes every model compiled use tfmp.

    Call it before building the model: layers take the global policy when they are
    created. Calling it again replaces the policy and options; the policy restored
    by `disable()` stays the one in force before the first call. Like Keras's
    global policy, it applies to the calling thread.

    Models compiled while enabled get float32 forcing; a `tfmp.LossScaleOptimizer`
    when they compute in float16 or bfloat16, or under float32 when `debug` or
    `loss_scale_options` ask for one (otherwise a float32 model keeps the
    optimizer it was given); and, with `debug`, `tfmp.check_numerics`. A model
    loaded with `keras.models.load_model` comes back exactly as saved. Training a
    model compiled before `enable()` warns at its first step.

    Args:
        policy: String or `keras.DTypePolicy`. ``"auto"`` (default) picks by
            hardware (see `tfmp.recommend_policy`); or ``"mixed_float16"``,
            ``"mixed_bfloat16"``, ``"float32"``.
        keep_float32: A layer class or layer-path glob pattern (e.g.
            ``"encoder/*_norm"``), or a sequence of them, to keep in float32 besides
            tfmp's defaults (outputs, softmax, normalization).
        exclude_float32: Same form: layers tfmp must not force.
        loss_scale_options: Dict or None. Keyword arguments for
            `tfmp.LossScaleOptimizer` (e.g. ``{"initial_scale": 2.0**15}``).
            Its ``guard`` says what a step is checked for before it is applied:
            by default the gradients under float16 (loss scaling needs it) and
            the loss alone otherwise (one scalar); ``{"guard": "gradients"}``
            checks every gradient under any policy, as ``debug`` does.
        allow_pure_16bit: Bool. Accept ``"float16"``/``"bfloat16"`` policies, which
            keep no float32 master weights. Default False.
        tf32: Bool or None. Switch TF32 matmuls on GPUs of compute capability
            >= 8.0 on or off; None leaves TensorFlow's setting (on by default).
        debug: Bool or dict. True instruments every model compiled while enabled
            with `tfmp.check_numerics` (first non-finite layer raises
            `tfmp.NonFiniteError`); a dict gives its keyword options, e.g.
            ``{"action": "warn", "phase": "forward"}``. Default False. Also
            makes the optimizer check every gradient (``guard="gradients"``)
            unless `loss_scale_options` set a guard.
        device_facts: `tfmp.DeviceFacts` or None. Device facts to decide "auto"
            for; None reads this machine's.

    Returns:
        `PolicyDecision`: `.policy` (Keras policy name) and `.reason`.

    Raises:
        ValueError: an unknown or unsafe policy, or a bad option (the message says
            what was received and how to fix it).

    Warns:
        tfmp.PerformanceWarning: an explicit policy slower than float32 here.
    """
    # Every argument is checked before any state changes: a bad call leaves
    # tfmp (and Keras) exactly as they were.
    check_bool("tf32", tf32, allow_none=True)
    keep_float32 = targets_from("keep_float32", keep_float32)
    exclude_float32 = targets_from("exclude_float32", exclude_float32)
    _check_debug(debug)
    decision = resolve_policy(
        policy, allow_pure_16bit=allow_pure_16bit, device_facts=device_facts
    )
    loss_scale_options = _checked_loss_scale_options(loss_scale_options, decision.compute_dtype)
    state = _current()
    previous = state.previous_policy if state else keras.config.dtype_policy()
    previous_tf32 = state.previous_tf32 if state else None
    if tf32 is not None and previous_tf32 is None:
        previous_tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    _set_current(
        _Enabled(decision, previous, previous_tf32, keep_float32, exclude_float32, loss_scale_options, debug)
    )
    if tf32 is not None:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
    keras.config.set_dtype_policy(decision.policy)
    return decision


def _checked_loss_scale_options(options: Optional[dict], compute_dtype: str) -> dict:
    """Validates `loss_scale_options` by building throwaway optimizers with them.

    Once as for float16 (every bound is checked with loss scaling on; a
    ``guard="loss"``, valid only without it, is left out there) and once for the
    policy's `compute_dtype` (``guard="loss"`` under float16 raises).
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise invalid_argument(
            "loss_scale_options", options, "a dict of tfmp.LossScaleOptimizer arguments",
            fix="Pass e.g. loss_scale_options={'initial_scale': 2.0**15}.",
        )
    for key in options:
        if key not in WRAP_OPTIONS:
            raise unknown_key("loss_scale_options", options, key, WRAP_OPTIONS)
    probe = {key: value for key, value in options.items() if (key, value) != ("guard", "loss")}
    wrap_optimizer("sgd", "float16", **probe)  # raises on a bad value
    wrap_optimizer("sgd", compute_dtype, **options)
    return dict(options)


def _check_debug(debug: Union[bool, dict]) -> None:
    """Validates the `debug` option of `enable()` against `tfmp.check_numerics`."""
    if isinstance(debug, bool):
        return
    if not isinstance(debug, dict):
        raise invalid_argument(
            "debug", debug, "a bool or a dict of tfmp.check_numerics options",
            fix="Pass debug=True, or e.g. debug={'action': 'warn'}.",
        )
    allowed = [name for name in inspect.signature(check_numerics).parameters
               if name not in ("model", "enabled")]
    for key in debug:
        if key not in allowed:
            raise unknown_key("debug", debug, key, allowed)


def disable() -> None:
    """Restores the policy in force before `enable()` and removes tfmp's hooks.

    Models already compiled keep their forced layers and optimizer. Changes
    nothing in this thread when tfmp is not enabled in it. The hooks into Keras
    come off when no live thread is enabled any more (a thread that ended
    without `disable()` counts as disabled).
    """
    state = _current()
    _set_current(None)  # also forgets threads that ended while enabled
    if state is None:
        return
    if state.previous_tf32 is not None:
        tf.config.experimental.enable_tensor_float_32_execution(state.previous_tf32)
    keras.config.set_dtype_policy(state.previous_policy)


@contextlib.contextmanager
def policy_scope(
    policy: Union[str, keras.DTypePolicy] = "auto", **options: Any
) -> Iterator[PolicyDecision]:
    """Context-manager form of `enable()`; restores the previous state on exit.

    Args:
        policy: As for `enable()`.
        **options: Keyword options of `enable()`.

    Yields:
        `PolicyDecision` in force inside the block.

    The previous global policy (and any enclosing `enable()` with its options) is
    back on exit, also when the block raises.
    """
    saved_state = _current()
    saved_policy = keras.config.dtype_policy()
    saved_tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        yield enable(policy, **options)
    finally:
        _set_current(saved_state)
        tf.config.experimental.enable_tensor_float_32_execution(saved_tf32)
        keras.config.set_dtype_policy(saved_policy)


def _warn_if_built_before_enable(model: keras.Model, policy: str) -> None:
    """Warns when `model`'s layers took another policy than tfmp's (built earlier)."""
    if model.dtype_policy.name != policy:
        warnings.warn(
            f"Model {model.name!r} was built under the policy "
            f"{model.dtype_policy.name!r}, not tfmp's {policy!r}, so its layers keep "
            f"computing in {model.dtype_policy.compute_dtype}. Layers take the global "
            "policy when they are created: build the model after tfmp.enable().",
            PerformanceWarning,
            stacklevel=user_stacklevel(),
        )


def _warn_if_compiled_before_enable(model: keras.Model) -> None:
    """At `fit`: warns once when `model` was compiled without tfmp while tfmp is on."""
    state = _current()
    if (
        state is None
        or state.decision.policy == "float32"
        or model_hooks.compiled_by_tfmp(model)
        or model_hooks.restored_by_keras(model)
        or model in _warned_compiled_before
    ):
        return
    _warned_compiled_before.add(model)
    optimizer = getattr(model, "optimizer", None)
    warnings.warn(
        f"Model {model.name!r} was compiled before tfmp.enable(): it trains with the "
        f"policy {model.dtype_policy.name!r} and the optimizer "
        f"{type(optimizer).__name__}, without tfmp's float32 forcing or loss-scale "
        f"optimizer, although tfmp's policy is {state.decision.policy!r}. Build and "
        "compile the model after tfmp.enable().",
        PerformanceWarning,
        stacklevel=user_stacklevel(),
    )


def _wants_optimizer_wrapper(model: keras.Model, state: _Enabled) -> bool:
    """Under float32 the optimizer stays the user's unless debug or options ask."""
    compute = model.dtype_policy.compute_dtype
    return compute in ("float16", "bfloat16") or bool(state.debug) or bool(state.loss_scale_options)


def _force_loaded(model: keras.Model) -> None:
    """While enabled, puts float32 forcing back on a model Keras is loading."""
    state = _current()
    if state is not None:
        force_loaded(model, keep=state.keep_float32, exclude=state.exclude_float32)


def _compile_with_tfmp(compile: Callable, model: keras.Model, args: tuple, kwargs: dict) -> Any:
    """tfmp's compile handler: force float32 where needed, wrap the optimizer.

    Also keeps float token ids exact for Embeddings under 16-bit custom code
    (`tfmp._src.float32.token_ids`) and, for a 16-bit model, hooks its ``build``
    and ``call`` to explain dtype mismatches (`tfmp._src.float32.dtype_errors`).

    Under a multi-replica `tf.distribute` strategy an explicit ``jit_compile=True``
    is turned off with a warning (see `tfmp._src.distribute`).
    """
    state = _current()
    if state is None:
        return compile(model, *args, **kwargs)
    args = list(args)
    optimizer = args.pop(0) if args else kwargs.pop("optimizer", "rmsprop")
    _warn_if_built_before_enable(model, state.decision.policy)
    force_float32(model, keep=state.keep_float32, exclude=state.exclude_float32)
    keep_exact_ids(model)
    if model.dtype_policy.compute_dtype in LOW_PRECISION:
        explain_dtype_errors(model)
    if optimizer is not None and _wants_optimizer_wrapper(model, state):
        options = state.loss_scale_options
        if state.debug:
            options = {"guard": "gradients", **options}
        optimizer = wrap_optimizer(optimizer, model.dtype_policy.compute_dtype, **options)
    result = compile(model, optimizer, *args, **kwargs)
    model_hooks.mark_compiled_by_tfmp(model)
    turn_off_xla_if_replicated(model)
    if state.debug:
        options = {} if state.debug is True else state.debug
        check_numerics(model, **options)
    return result
