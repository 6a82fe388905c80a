"""Context managers around one model's train, test and predict functions and steps.

`trace_in` wraps the model's ``*_step`` (owner ``"attachment"``): Keras calls them only while
tracing, so its scope is entered once per trace. `install` wraps the functions Keras makes
(``make_*_function``, owner ``"step_scope"``, inside `train_function`'s wrapper), so tracing,
Grappler and each call run in the scope on the calling thread. Each wrapper carries ``tfmp_inner``.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, Optional

from tfmp._src.keras_hooks import patches, trainer
from tfmp._src.keras_hooks.object_state import PerObjectHooks

#: The kinds of ``<kind>_function`` / ``make_<kind>_function`` / ``<kind>_step`` a scope covers.
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
        """Takes the hooks off and puts each wrapped function back (one under another wrapper passes through)."""
        self.active = False
        for hook in reversed(self.hooks):
            hook.remove()
        for kind, wrapper in self.wrappers.items():
            attribute = f"{kind}_function"
            if getattr(self.model, attribute, None) is wrapper:
                object.__setattr__(self.model, attribute, self.inners[kind])


def install(model: Any, scope: Scope, *, name: str) -> None:
    """Runs every call of `model`'s train, test and predict functions inside `scope()`, named `name`.

    Replaces an earlier scope; a hook that fails to install leaves the model as before.
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
    """Runs `model`'s ``*_step`` inside `scope()` (replacing an earlier one); call before Keras binds them (compile)."""
    _TRACED.replace(model, lambda: _TraceScope(model, scope))


def untrace(model: Any) -> None:
    """Takes `model`'s step scope off (nothing when it has none)."""
    _TRACED.discard(model)


def trace_scope_entry(model: Any) -> Optional[Scope]:
    """The scope callable `model`'s steps run in (`tfmp.step_scope` enters it too), or None."""
    state = _TRACED.get(model)
    return None if state is None else state.scope
