"""`tfmp.enable()`, `tfmp.disable()` and `tfmp.policy_scope()`: global state and the compile hook.

While enabled, `keras.Model.compile` is wrapped so that every model compiled gets
float32 forcing (`tfmp.force_float32`), a `tfmp.LossScaleOptimizer` and, with
``debug=True``, `tfmp.check_numerics` hooks without further calls. `disable()`
restores the previous global policy, the original `compile` and the TF32 setting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import warnings
from typing import Any, Iterator, Optional, Sequence, Union

import keras
import tensorflow as tf

from tfmp._distribute import turn_off_xla_if_replicated
from tfmp._errors import invalid_argument
from tfmp._float32 import force_float32
from tfmp._hardware import DeviceFacts
from tfmp._loss_scale import WRAP_OPTIONS
from tfmp._loss_scale import wrap_optimizer
from tfmp._numerics import check_numerics
from tfmp._policy import PerformanceWarning, PolicyDecision, resolve_policy
from tfmp._registry import targets_from

_MISSING = object()


@dataclasses.dataclass
class _Enabled:
    """What `enable()` changed, so that `disable()` can put it back."""

    decision: PolicyDecision
    previous_policy: keras.DTypePolicy
    previous_compile: Any  # Model.__dict__["compile"] before patching, or _MISSING
    previous_tf32: Optional[bool]
    keep_float32: Sequence[Any]
    exclude_float32: Sequence[Any]
    loss_scale_options: dict
    debug: Union[bool, dict] = False


_state: Optional[_Enabled] = None


def is_enabled() -> bool:
    """Bool. True between `tfmp.enable()` and `tfmp.disable()`."""
    return _state is not None


def current_decision() -> Optional[PolicyDecision]:
    """The `PolicyDecision` in force, or None when tfmp is not enabled."""
    return _state.decision if _state else None


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
    """Sets the Keras global dtype policy and hooks `Model.compile`.

    Call it before building the model: layers take the global policy when they are
    created. Calling it again replaces the policy and options; the policy restored
    by `disable()` stays the one in force before the first call.

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
        allow_pure_16bit: Bool. Accept ``"float16"``/``"bfloat16"`` policies, which
            keep no float32 master weights. Default False.
        tf32: Bool or None. Switch TF32 matmuls on GPUs of compute capability
            >= 8.0 on or off; None leaves TensorFlow's setting (on by default).
        debug: Bool or dict. True instruments every model compiled while enabled
            with `tfmp.check_numerics` (first non-finite layer raises
            `tfmp.NonFiniteError`); a dict gives its keyword options, e.g.
            ``{"action": "warn", "phase": "forward"}``. Default False.
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
    global _state
    # Every argument is checked before any state changes: a bad call leaves
    # tfmp (and Keras) exactly as they were.
    if tf32 not in (None, True, False):
        raise invalid_argument("tf32", tf32, "None, True or False")
    keep_float32 = targets_from("keep_float32", keep_float32)
    exclude_float32 = targets_from("exclude_float32", exclude_float32)
    loss_scale_options = _checked_loss_scale_options(loss_scale_options)
    _check_debug(debug)
    decision = resolve_policy(
        policy, allow_pure_16bit=allow_pure_16bit, device_facts=device_facts
    )
    if _state is None:
        _state = _Enabled(
            decision=decision,
            previous_policy=keras.config.dtype_policy(),
            previous_compile=keras.Model.__dict__.get("compile", _MISSING),
            previous_tf32=None,
            keep_float32=(),
            exclude_float32=(),
            loss_scale_options={},
        )
        keras.Model.compile = _compile_with_tfmp(keras.Model.compile)
    _state.decision = decision
    _state.keep_float32 = keep_float32
    _state.exclude_float32 = exclude_float32
    _state.loss_scale_options = loss_scale_options
    _state.debug = debug
    if tf32 is not None:
        if _state.previous_tf32 is None:
            _state.previous_tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
    keras.config.set_dtype_policy(decision.policy)
    return decision


def _checked_loss_scale_options(options: Optional[dict]) -> dict:
    """Validates `loss_scale_options` by building a throwaway optimizer with them."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise invalid_argument(
            "loss_scale_options", options, "a dict of tfmp.LossScaleOptimizer arguments",
            fix="Pass e.g. loss_scale_options={'initial_scale': 2.0**15}.",
        )
    for key in options:
        if key not in WRAP_OPTIONS:
            raise invalid_argument(
                "loss_scale_options", options,
                "keys among " + ", ".join(WRAP_OPTIONS),
                fix=_suggestion(key, WRAP_OPTIONS),
            )
    wrap_optimizer("sgd", "float16", **options)  # raises on a bad value
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
            raise invalid_argument(
                "debug", debug, "keys among " + ", ".join(allowed),
                fix=_suggestion(key, allowed),
            )


def _suggestion(key: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(key), list(choices), n=1, cutoff=0.6)
    return f"Unknown key {key!r}; did you mean {close[0]!r}?" if close else f"Unknown key {key!r}."


def disable() -> None:
    """Restores the policy in force before `enable()` and removes the compile hook.

    Models already compiled keep their forced layers and optimizer. Does nothing
    when tfmp is not enabled.
    """
    global _state
    if _state is None:
        return
    state, _state = _state, None
    _set_model_compile(state.previous_compile)
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
    global _state
    saved_state = dataclasses.replace(_state) if _state is not None else None
    saved_compile = keras.Model.__dict__.get("compile", _MISSING)
    saved_policy = keras.config.dtype_policy()
    saved_tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        yield enable(policy, **options)
    finally:
        _state = saved_state
        _set_model_compile(saved_compile)
        tf.config.experimental.enable_tensor_float_32_execution(saved_tf32)
        keras.config.set_dtype_policy(saved_policy)


def _set_model_compile(entry: Any) -> None:
    """Puts back `Model.__dict__["compile"]` as it was (absent when _MISSING)."""
    if entry is _MISSING:
        if "compile" in keras.Model.__dict__:
            del keras.Model.compile
    else:
        keras.Model.compile = entry


def _warn_if_built_before_enable(model: keras.Model, policy: str) -> None:
    """Warns when `model`'s layers took another policy than tfmp's (built earlier)."""
    if model.dtype_policy.name != policy:
        warnings.warn(
            f"Model {model.name!r} was built under the policy "
            f"{model.dtype_policy.name!r}, not tfmp's {policy!r}, so its layers keep "
            f"computing in {model.dtype_policy.compute_dtype}. Layers take the global "
            "policy when they are created: build the model after tfmp.enable().",
            PerformanceWarning,
            stacklevel=3,
        )


def _compile_with_tfmp(original_compile):
    """Wraps `Model.compile`: force float32 where needed, wrap the optimizer.

    Under a multi-replica `tf.distribute` strategy an explicit ``jit_compile=True``
    is turned off with a warning (see `tfmp._distribute`).
    """

    @functools.wraps(original_compile)
    def compile(self, *args, **kwargs):
        if _state is not None:
            args = list(args)
            if args:
                optimizer = args.pop(0)
            else:
                optimizer = kwargs.pop("optimizer", "rmsprop")
            _warn_if_built_before_enable(self, _state.decision.policy)
            force_float32(
                self, keep=_state.keep_float32, exclude=_state.exclude_float32
            )
            if optimizer is not None:
                optimizer = wrap_optimizer(
                    optimizer,
                    self.dtype_policy.compute_dtype,
                    **_state.loss_scale_options,
                )
            result = original_compile(self, optimizer, *args, **kwargs)
            turn_off_xla_if_replicated(self)
            if _state.debug:
                options = {} if _state.debug is True else _state.debug
                check_numerics(self, **options)
            return result
        return original_compile(self, *args, **kwargs)

    compile._tfmp_original = original_compile
    return compile
