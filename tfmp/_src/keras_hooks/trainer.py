"""The trainer surface: compile, loading, the train/test/predict functions, ``fit``, the saved compile config.

The class-level hooks are here (subscribers innermost first in `SURFACE`); `train_function`,
`step_scope`, `fit_lifecycle` and `multi_worker` are per-model dispatchers on the same surface.
Keras 3.16 renamed the trainer classes (`BASE_TRAINER_NAMES`, `TENSORFLOW_TRAINER_NAMES`): each is
found by the method it defines (`patches.defining_class`). Handlers decide per thread; hooks are process-wide.

| private name used | where in Keras | what tfmp does with it |
|---|---|---|
| ``Trainer._loss_tracker`` (Keras 3.12-3.15), ``BaseTrainer._loss_tracker`` (3.16) | ``keras/src/trainers/trainer.py`` | `loss_tracker`: samples seen this epoch (the monitor's throughput) |
| ``Trainer.compile`` (Keras 3.12-3.15), ``BaseTrainer.compile`` (3.16): its identity in ``compile_from_config`` | ``keras/src/trainers/trainer.py`` | the compile hook is set on the class that defines ``compile`` (`patches.defining_class`), so loading still compiles |
| ``TensorFlowTrainer._maybe_symbolic_build`` (Keras 3.12-3.15), ``Trainer._maybe_symbolic_build`` (3.16) (`multi_worker.SYMBOLIC_BUILD`) | ``keras/src/backend/tensorflow/trainer.py`` | hooked per model under a multi-worker strategy (`multi_worker`) |
| ``Layer._setattr_hook`` (`SETATTR_HOOK`) | ``keras/src/backend/tensorflow/layer.py``, ``keras/src/ops/operation.py`` | `tfmp._src.loss_scale.custom_optimizers` sees optimizers a custom ``compile`` stores on a model |
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, List, Optional, Tuple

import keras

from tfmp._src.keras_hooks import patches
from tfmp._src.keras_hooks.patches import defining_class

Hook = patches.Hook  # what subscribing returns: `.remove()` unsubscribes
SURFACE = patches.Surface(
    "trainer",
    methods=("compile", "compile_from_config", "get_compile_config", "make_train_function",
             "make_test_function", "make_predict_function", "train_step", "test_step", "predict_step", "fit", "_setattr_hook",
             "quantize", "_maybe_symbolic_build"),
    subscribers=("custom_optimizers", "numerics", "loss_scale.batch", "multi_worker", "enable.quantize_hint",
                 "enable.compile", "loss_scale.fit_check", "enable.first_step", "fit_lifecycle",
                 "step_scope", "saved_form", "train_function", "attachment"),
)
subscribe = SURFACE.subscribe
subscribed = SURFACE.subscribed

#: (class whose method is hooked, method, the parameters tfmp relies on, in order).
SIGNATURES: Tuple[Tuple[type, str, Tuple[str, ...]], ...] = (
    # compile: the optimizer is the first argument or `optimizer=`; loading sets `auto_scale_loss=False`.
    (keras.Model, "compile", ("optimizer", "loss")),
    (keras.Model, "compile_from_config", ("config",)),
    # train_function: `make_train_function(force=False)`.
    (keras.Model, "make_train_function", ("force",)),
    # step_scope: `make_test_function(force=False)`, `make_predict_function(force=False)`.
    (keras.Model, "make_test_function", ("force",)),
    (keras.Model, "make_predict_function", ("force",)),
    # numerics: `train_step(data)`.
    (keras.Model, "train_step", ("data",)),
    # custom_optimizers: Layer.__setattr__ calls `_setattr_hook(name, value)`, which returns both.
    (keras.Model, "_setattr_hook", ("name", "value")),
    # multi_worker: `train_step(data)`, `test_step(data)`, `_maybe_symbolic_build(iterator=None, data_batch=None)`.
    (keras.Model, "test_step", ("data",)),
    # step_scope: `train_step(data)`, `test_step(data)`, `predict_step(data)`.
    (keras.Model, "predict_step", ("data",)),
    (keras.Model, "_maybe_symbolic_build", ("iterator", "data_batch")),
)

#: Private methods tfmp hooks per model, which the installed Keras must have.
REQUIRED_ATTRIBUTES = ((keras.Model, "_maybe_symbolic_build"),)

#: (what tfmp relies on Keras doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = (
    ("fit calls make_train_function, then model.train_function once per execution",
     "tests/test_keras_hooks.py::test_train_function_checks_run_in_order_and_come_off_independently"),
    ("load_model compiles through compile_from_config, which calls compile",
     "tests/test_invisible.py::test_loading_a_mixed_float16_model_with_overflows_while_enabled_keeps_its_state"),
    ("fit raises out of itself whatever a callback or the data iterator raises, without on_train_end",
     "tests/test_monitor.py::test_any_error_out_of_fit_closes_the_monitor_and_the_next_fit_starts_clean"),
    ("make_train_function binds model.train_step when it makes the function (a later train_step hook needs a remake)",
     "tests/test_safety.py::test_one_nan_input_the_forward_pass_hides_is_skipped"),
    ("Layer.__setattr__ passes each assignment on a model through the instance's _setattr_hook",
     "tests/test_custom_compile.py::test_optimizers_set_before_super_compile_or_after_it_are_wrapped_and_lists_warned_about"),
    ("saving writes model.get_compile_config() (the base trainer's, hooked while tfmp optimizers live) and, under "
     "optimizer/<attribute>, every KerasSaveable attribute of the optimizer (loss_scale_counters); "
     "loading a built-in class accepts a registered_name equal to its class name and ignores "
     "unknown keys beside an entry's config (saved_form)",
     "tests/test_saved_form.py::test_a_file_saved_under_tfmp_opens_in_plain_keras_in_a_process_without_tfmp"),
    ("fit, evaluate and predict call make_train/test/predict_function, then the model's "
     "train/test/predict_function, in the calling thread",
     "tests/test_float16_fusion.py::test_with_the_trap_a_float16_model_steps_without_fused_matmuls_and_a_float32_model_keeps_them"),
    ("under a multi-worker strategy, fit and evaluate call _maybe_symbolic_build(iterator=...) before any "
     "step, and Keras's own build raises error_texts.PER_REPLICA_CONVERSION there (multi_worker; the test "
     "fails once Keras fixes it)",
     "tests/test_multi_worker_fit.py::test_plain_keras_fit_still_fails_under_multi_worker_and_tfmp_fit_matches_one_process"),
)

#: Keras 3.12-3.15's, then 3.16's name of the class defining ``compile`` and ``fit`` (``keras/src/trainers``).
BASE_TRAINER_NAMES: Tuple[str, ...] = ("Trainer", "BaseTrainer")

#: Keras 3.12-3.15's, then 3.16's name of the TensorFlow trainer defining ``make_train_function``.
TENSORFLOW_TRAINER_NAMES: Tuple[str, ...] = ("TensorFlowTrainer", "Trainer")

#: What ``Layer.__setattr__`` calls first with ``(name, value)``, storing the pair it returns.
SETATTR_HOOK = "_setattr_hook"


def loss_tracker(model: Any) -> Optional[Any]:
    """The `keras.metrics.Mean` a compiled model updates with each batch's loss, or None."""
    return getattr(model, "_loss_tracker", None)


_local = threading.local()
#: Models tfmp's compile handler compiled, and models Keras compiled while loading.
_COMPILED: "weakref.WeakSet[Any]" = weakref.WeakSet()
_RESTORED: "weakref.WeakSet[Any]" = weakref.WeakSet()

CompileHandler = Callable[[Callable, Any, tuple, dict], Any]


def _restoring() -> bool:
    return getattr(_local, "restoring", 0) > 0


def install_compile_hook(
    handler: CompileHandler,
    *,
    keep_saved: Callable[[], bool] = lambda: True,
    on_load: Callable[[Any, Any, Any], None] = lambda model, loss, optimizer: None,
) -> List[patches.Hook]:
    """Routes ``Model.compile`` to ``handler(compile, model, args, kwargs)``, which calls ``compile`` itself.

    Hooked where ``compile`` is defined, so ``compile_from_config`` still compiles a model Keras loads;
    there `handler` is bypassed: ``on_load(model, loss, optimizer)`` runs first (layers built, weights not loaded),
    and while ``keep_saved()`` Keras's ``auto_scale_loss`` is off (under a ``mixed_float16`` global
    policy Keras would wrap a saved plain optimizer, then skip loading its variables).

    Returns:
        List of `patches.Hook` (compile, compile_from_config).
    """

    def wrap_compile(compile: Callable) -> Callable:
        @functools.wraps(compile)
        def tfmp_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _restoring():
                _RESTORED.add(self)
                on_load(self, kwargs.get("loss", args[1] if len(args) > 1 else None),
                        kwargs.get("optimizer", args[0] if args else None))
                if keep_saved():
                    kwargs.setdefault("auto_scale_loss", False)
                return compile(self, *args, **kwargs)
            _COMPILED.discard(self)
            _RESTORED.discard(self)
            return handler(compile, self, args, kwargs)

        return tfmp_compile

    def wrap_from_config(compile_from_config: Callable) -> Callable:
        @functools.wraps(compile_from_config)
        def tfmp_compile_from_config(self: Any, config: Any) -> Any:
            _local.restoring = getattr(_local, "restoring", 0) + 1
            try:
                return compile_from_config(self, config)
            finally:
                _local.restoring -= 1

        return tfmp_compile_from_config

    return [
        subscribe(defining_class(keras.Model, "compile"), "compile", wrap_compile, owner="enable.compile"),
        subscribe(
            defining_class(keras.Model, "compile_from_config"),
            "compile_from_config",
            wrap_from_config,
            owner="enable.compile",
        ),
    ]


def install_compile_config_hook(rewrite: Callable[[Any], Any], *, owner: str, model: Any = None) -> patches.Hook:
    """Routes the config (dict or None) ``get_compile_config()`` returns, which saving writes, through `rewrite`.

    Hooks `model`'s own method, or the class's when `model` is None (an override not calling Keras's
    is not reached).
    """

    def wrap(get_compile_config: Callable) -> Callable:
        @functools.wraps(get_compile_config)
        def rewritten(*self: Any) -> Any:  # (self,) on the class, () on a model
            return rewrite(get_compile_config(*self))

        return rewritten

    target = defining_class(keras.Model, "get_compile_config") if model is None else model
    return subscribe(target, "get_compile_config", wrap, owner=owner)


def install_make_train_function_hook(handler: Callable[[Any], None], *, owner: str,
                                     model: Any = None) -> patches.Hook:
    """Calls ``handler(model)`` (cheap, idempotent) after each ``make_train_function``: `model`'s, or any (None).

    Keras calls it at every ``fit`` and ``train_on_batch``; the model's ``train_function`` then exists.
    """

    def wrap(make: Callable) -> Callable:
        @functools.wraps(make)
        def make_train_function(*args: Any, **kwargs: Any) -> Any:  # (self, ...) on the class
            result = make(*args, **kwargs)
            handler(args[0] if model is None else model)
            return result

        return make_train_function

    target = defining_class(keras.Model, "make_train_function") if model is None else model
    return subscribe(target, "make_train_function", wrap, owner=owner)


def mark_compiled_by_tfmp(model: Any) -> None:
    """Records that tfmp's compile handler compiled `model` (until its next compile)."""
    _COMPILED.add(model)


def compiled_by_tfmp(model: Any) -> bool:
    """Bool. tfmp's compile handler compiled `model` at its last compile (tfmp on in the compiling thread)."""
    return model in _COMPILED


def restored_by_keras(model: Any) -> bool:
    """Bool. Whether Keras compiled `model` while loading it (tfmp left it as saved)."""
    return model in _RESTORED
