"""Class-level hooks on every Keras model: compile, loading, making the train function, the saved compile config.

- ``compile``: `install_compile_hook` routes every ``Model.compile`` call to tfmp's
  handler (float32 forcing, optimizer wrapping, numerics), on the class that
  defines ``compile`` (see `keras_private.defining_class`), so that Keras's
  ``compile_from_config`` still sees an unchanged ``compile`` and compiles models
  it loads.
- ``compile_from_config``: while Keras compiles a model it is loading, tfmp's
  handler is bypassed: the model comes back exactly as it was saved (optimizer
  class, iterations, slots, loss scale and counters). Where the caller asks for
  it (`install_compile_hook`'s ``keep_saved``), Keras's own ``auto_scale_loss``
  is off for that compile too: Keras would otherwise wrap a saved plain
  optimizer in its ``LossScaleOptimizer`` when the global policy is
  ``mixed_float16`` (a ``Sequential`` model takes the global policy, not its
  saved one, when loaded), and then skip loading the saved optimizer variables
  because their count differs. The caller's ``on_load`` runs first (tfmp puts
  back its float32 forcing hooks, which saving does not keep).
- ``get_compile_config`` (`install_compile_config_hook`): what Keras's saving
  writes as a model's compile config, rewritten.
- ``make_train_function``: `install_make_train_function_hook` calls a handler
  when ``fit`` starts, e.g. to warn about a model compiled before `tfmp.enable()`
  or to attach the loss-scale optimizer's stuck check to the model.

The handlers decide per thread whether tfmp is on (Keras keeps its dtype policy
per thread, and so does tfmp); the hooks themselves are process-wide.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, List

import keras

from tfmp._src.keras_hooks import patches
from tfmp._src.keras_hooks.keras_private import defining_class

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
    on_load: Callable[[Any, Any], None] = lambda model, loss: None,
) -> List[patches.Hook]:
    """Routes ``Model.compile`` to ``handler(compile, model, args, kwargs)``.

    Args:
        handler: Callable. Receives Keras's ``compile`` (unbound), the model and
            the call's arguments, and must call ``compile`` itself. Not called
            while Keras compiles a model it is loading. It returns what
            ``compile`` returned; it calls `mark_compiled_by_tfmp` on models it
            changed.
        keep_saved: Callable returning a bool, asked in the loading thread when
            Keras compiles a model it is loading: True turns Keras's
            ``auto_scale_loss`` off for that compile, so the saved optimizer is
            kept as it is (see the module docstring). Default: always.
        on_load: Callable taking the model and the ``loss`` it is compiled
            with, called in the loading thread just before Keras compiles a
            model it is loading (the layers are built,
            the weights not loaded yet), e.g. to put back per-layer hooks that
            saving does not keep. Default: nothing.

    Returns:
        List of `patches.Hook` (compile, compile_from_config); remove each to undo.
    """

    def wrap_compile(compile: Callable) -> Callable:
        @functools.wraps(compile)
        def tfmp_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _restoring():
                _RESTORED.add(self)
                on_load(self, kwargs.get("loss", args[1] if len(args) > 1 else None))
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
        patches.install(defining_class(keras.Model, "compile"), "compile", wrap_compile, owner="enable.compile"),
        patches.install(
            defining_class(keras.Model, "compile_from_config"),
            "compile_from_config",
            wrap_from_config,
            owner="enable.compile",
        ),
    ]


def install_compile_config_hook(rewrite: Callable[[Any], Any], *, owner: str) -> patches.Hook:
    """Routes what every model's ``get_compile_config()`` returns through ``rewrite``.

    Keras's saving calls ``get_compile_config`` on the model to write its
    compile config into the file. A subclass that overrides the method without
    calling Keras's is not reached.

    Args:
        rewrite: Callable taking the config Keras made (dict or None) and
            returning the one to save.
        owner: String, the hook's owner (a key of `patches.ORDER`).

    Returns:
        `patches.Hook`; remove it to undo.
    """

    def wrap(get_compile_config: Callable) -> Callable:
        @functools.wraps(get_compile_config)
        def rewritten(self: Any) -> Any:
            return rewrite(get_compile_config(self))

        return rewritten

    trainer = defining_class(keras.Model, "get_compile_config")
    return patches.install(trainer, "get_compile_config", wrap, owner=owner)


def install_make_train_function_hook(handler: Callable[[Any], None], *, owner: str) -> patches.Hook:
    """Calls ``handler(model)`` each time Keras makes a model's train function.

    Keras makes it at every ``fit`` and ``train_on_batch`` call (building it the
    first time or after a forced retrace, else returning the one it has). The
    handler runs after Keras, so the model's ``train_function`` exists; it should
    be cheap and idempotent.

    Args:
        handler: Callable taking the model.
        owner: String, the hook's owner (a key of `patches.ORDER`).

    Returns:
        `patches.Hook`; remove it to undo.
    """

    def wrap(make: Callable) -> Callable:
        @functools.wraps(make)
        def make_train_function(self: Any, force: bool = False) -> Any:
            result = make(self, force)
            handler(self)
            return result

        return make_train_function

    trainer = defining_class(keras.Model, "make_train_function")
    return patches.install(trainer, "make_train_function", wrap, owner=owner)


def mark_compiled_by_tfmp(model: Any) -> None:
    """Records that tfmp's compile handler compiled `model` (until its next compile)."""
    _COMPILED.add(model)


def compiled_by_tfmp(model: Any) -> bool:
    """Bool. Whether tfmp's compile handler compiled `model` at its last compile.

    False for a model compiled while tfmp was off in the compiling thread, even
    while another thread had it on.
    """
    return model in _COMPILED


def restored_by_keras(model: Any) -> bool:
    """Bool. Whether Keras compiled `model` while loading it (tfmp left it as saved)."""
    return model in _RESTORED
