"""Context managers around one model's train, test and predict functions and steps.

`trace_in` wraps the model's own ``train_step``, ``test_step`` and ``predict_step``
(owner ``"attachment"``, outermost on each): Keras calls them only while it traces the
function, so a scope there (`tfmp._src.attachment.hooks.in_step`) is entered once per
trace, not per batch (per batch under ``run_eagerly``). `install` wraps the model's own
``make_train_function``, ``make_test_function`` and ``make_predict_function`` through `patches`, so each function Keras builds runs inside a
scope (a callable returning a context manager, e.g.
`tfmp._src.policy.float16_fusion.remapper_off`): tracing, Grappler and the step run in
it, on the calling thread. `remove` takes it off; a model without a scope has no
wrapper. The scope is inner to `tfmp._src.keras_hooks.train_function`'s wrapper (owner
``"step_scope"`` inside ``"train_function"`` in `trainer.SURFACE`), whose checks run on
the host after the call. Each wrapper carries what it wraps as ``tfmp_inner`` and is
not put on twice.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, Optional

from tfmp._src.keras_hooks import patches, trainer
from tfmp._src.keras_hooks.object_state import PerObjectHooks

#: The model functions a scope covers, as ``<kind>_function`` / ``make_<kind>_function`` / ``<kind>_step``.
KINDS = ("train", "test", "predict")
_STATE = PerObjectHooks("step_scope")
_TRACED = PerObjectHooks("trace_scope")

Scope = Callable[[], ContextManager[Any]]


def wraps(function: Any, wrapper: Any) -> bool:
    """Bool. Whether `wrapper` is `function` or below it in its ``tfmp_inner`` chain."""
    while function is not None:
        if function is wrapper:
            return True
        function = getattr(function, "tfmp_inner", None)
    return False


class _ModelScope:
    """The scope of one model, its three wrappers and its ``make_*_function`` hooks."""

    def __init__(self, model: Any, scope: Scope, name: str) -> None:
        self.model, self.scope, self.name, self.active = model, scope, name, True
        self.wrappers: Dict[str, Callable] = {}
        self.inners: Dict[str, Callable] = {}
        self.hooks = patches.install_all([
            (lambda kind=kind: trainer.subscribe(
                model, f"make_{kind}_function", self._wrap_make(kind), owner="step_scope"))
            for kind in KINDS
        ])
        for kind in KINDS:
            self._wrap_current(kind)

    def _wrap_make(self, kind: str) -> Callable[[Callable], Callable]:
        def wrap(make: Callable) -> Callable:
            def make_function(force: bool = False) -> Any:
                result = make(force)
                self._wrap_current(kind)
                return None if result is None else getattr(self.model, f"{kind}_function")

            return make_function

        return wrap

    def _wrap_current(self, kind: str) -> None:
        """Wraps the model's `kind` function unless this scope's wrapper is in it."""
        attribute = f"{kind}_function"
        current = getattr(self.model, attribute, None)
        if current is None or wraps(current, self.wrappers.get(kind)):
            return
        inner, state = current, self

        def scoped_function(*args: Any, **kwargs: Any) -> Any:
            if not state.active:  # removed while another wrapper sits on top
                return inner(*args, **kwargs)
            with state.scope():
                return inner(*args, **kwargs)

        scoped_function.tfmp_inner = inner
        scoped_function.tfmp_scope = self.name
        self.wrappers[kind], self.inners[kind] = scoped_function, inner
        object.__setattr__(self.model, attribute, scoped_function)

    def remove(self) -> None:
        """Takes the hooks off and puts back each function this scope wrapped.

        A wrapper under another one (the train-step checks') cannot be taken
        out of the chain; it stays there as a pass-through.
        """
        self.active = False
        for hook in reversed(self.hooks):
            hook.remove()
        for kind, wrapper in self.wrappers.items():
            attribute = f"{kind}_function"
            if getattr(self.model, attribute, None) is wrapper:
                object.__setattr__(self.model, attribute, self.inners[kind])


def install(model: Any, scope: Scope, *, name: str) -> None:
    """Runs every call of `model`'s train, test and predict functions inside `scope()`.

    Args:
        model: `keras.Model`.
        scope: Callable without arguments returning a context manager, entered
            around each call (in the calling thread).
        name: String. What the scope is (``scope_of`` returns it), e.g.
            ``"remapper off"``.

    A second `install` on the same model replaces the first scope.

    Raises:
        Whatever installing a hook raises; the model is then as before.
    """
    _STATE.replace(model, lambda: _ModelScope(model, scope, name))


def remove(model: Any) -> None:
    """Takes `model`'s scope off (nothing when it has none); Keras's functions are back."""
    _STATE.discard(model)


def scope_entry(model: Any) -> Optional[Scope]:
    """The scope callable `model`'s functions run in (a custom loop enters it too), or None."""
    state = _STATE.get(model)
    return None if state is None else state.scope


def scope_of(model: Any) -> Optional[str]:
    """The name of the scope `model`'s functions run in, or None."""
    state = _STATE.get(model)
    return None if state is None else state.name


class _TraceScope:
    """The scope entered around one model's steps, and its hooks on them."""

    def __init__(self, model: Any, scope: Scope) -> None:
        self.scope = scope
        self.hooks = patches.install_all([
            (lambda kind=kind: trainer.subscribe(model, f"{kind}_step", self._wrap, owner="attachment"))
            for kind in KINDS
        ])

    def _wrap(self, step: Callable) -> Callable:
        def scoped_step(data: Any) -> Any:
            with self.scope():
                return step(data)

        return scoped_step

    def remove(self) -> None:
        for hook in reversed(self.hooks):
            hook.remove()


def trace_in(model: Any, scope: Scope) -> None:
    """Runs `model`'s ``train_step``, ``test_step`` and ``predict_step`` inside `scope()`.

    Keras binds the steps when it makes a function: call before it does (at
    compile, which drops the functions Keras made). A second call replaces the
    first scope.

    Raises:
        Whatever installing a hook raises; the model is then as before.
    """
    _TRACED.replace(model, lambda: _TraceScope(model, scope))


def untrace(model: Any) -> None:
    """Takes `model`'s step scope off (nothing when it has none)."""
    _TRACED.discard(model)


def trace_scope_entry(model: Any) -> Optional[Scope]:
    """The scope callable `model`'s steps run in (`tfmp.step_scope` enters it too), or None."""
    state = _TRACED.get(model)
    return None if state is None else state.scope
