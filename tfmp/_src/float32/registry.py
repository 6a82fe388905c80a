"""Which layers tfmp keeps in float32: built-in rules plus a user registry.

Built-in rules (why: 16 bits cannot hold the numbers these layers produce):

* Softmax layers and ``Activation("softmax"/"log_softmax")``: ``exp`` of a logit
  above ~11 overflows float16 (largest finite value 65504); row sums lose digits.
* Normalization layers (BatchNormalization, LayerNormalization,
  GroupNormalization, UnitNormalization, RMSNormalization where Keras has it):
  their mean/variance sums overflow or lose precision in 16 bits.
* Layers with a fused ``softmax``/``log_softmax`` activation (e.g.
  ``Dense(10, activation="softmax")``), anywhere in the model.
* Layers that produce a model output (handled in ``tfmp._src.float32.force``), which also
  covers a fused ``sigmoid`` in output position. Keras's own mixed-precision guide
  asks for float32 outputs for the same reason.

Users add targets (layer classes, or glob patterns over layer paths such as
``"encoder/*_norm"``) with :func:`register_float32`, and opt out of any rule,
built-in or not, with ``register_float32(..., exclude=True)``. Exclusion always
wins over keeping. Registrations are process-wide until removed with
:func:`unregister_float32`, or undone on leaving a ``with`` block::

    with tfmp.register_float32("*logits"):
        tfmp.force_float32(model)
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable, List, Optional, Tuple, Type, Union

import keras

from tfmp._src.errors import invalid_argument

Target = Union[Type[keras.layers.Layer], str]

_NORMALIZATION_NAMES = (
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "UnitNormalization",
    "RMSNormalization",  # Keras >= 3.9.
)
BUILTIN_CLASSES: Tuple[type, ...] = (keras.layers.Softmax,) + tuple(
    getattr(keras.layers, name)
    for name in _NORMALIZATION_NAMES
    if hasattr(keras.layers, name)
)
SOFTMAX_ACTIVATIONS = frozenset({"softmax", "log_softmax"})

_keep: List[Target] = []
_exclude: List[Target] = []


@dataclasses.dataclass(frozen=True)
class Float32Rules:
    """Snapshot of the float32 rules in force, returned by :func:`float32_layers`.

    Attributes:
        builtin: Tuple of layer classes tfmp always keeps in float32.
        keep: Tuple of user-registered classes or path patterns to keep.
        exclude: Tuple of user-registered classes or path patterns never forced.
    """

    builtin: Tuple[type, ...]
    keep: Tuple[Target, ...]
    exclude: Tuple[Target, ...]


class Registration:
    """Handle returned by :func:`register_float32`; a ``with`` block undoes it.

    On exit (also when the body raised) it removes exactly the targets this call
    added, so targets registered earlier stay registered.
    """

    def __init__(self, added: List[Target], exclude: bool) -> None:
        self.added = tuple(added)
        self.exclude = exclude

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc_info: object) -> None:
        table = _exclude if self.exclude else _keep
        for target in self.added:
            if target in table:
                table.remove(target)

    def __repr__(self) -> str:
        kind = "exclude" if self.exclude else "keep"
        return f"Registration({kind}={list(self.added)!r})"


def targets_from(name: str, targets: Union[Target, Iterable[Target], None]) -> Tuple[Target, ...]:
    """Validates ``keep``/``exclude`` style arguments into a tuple of targets.

    Args:
        name: String. Argument name used in error messages, e.g. ``"keep"``.
        targets: A layer class, a glob pattern string, an iterable of those, or
            None (no targets).

    Returns:
        Tuple of layer classes and pattern strings.

    Raises:
        ValueError: (project template) an element is neither a subclass of
            ``keras.layers.Layer`` nor a non-empty string.
    """
    if targets is None:
        return ()
    if isinstance(targets, (str, type)):
        targets = (targets,)
    result = []
    for target in targets:
        is_class = isinstance(target, type) and issubclass(target, keras.layers.Layer)
        if not (is_class or (isinstance(target, str) and target)):
            raise invalid_argument(
                name,
                target,
                "a keras.layers.Layer subclass or a layer-path glob pattern "
                "such as 'encoder/*_norm'",
                fix="Pass the class itself (keras.layers.Dense), not an instance, "
                "or a non-empty pattern string.",
            )
        result.append(target)
    return tuple(result)


def register_float32(*targets: Target, exclude: bool = False) -> Registration:
    """Registers layer classes or path patterns to keep in (or keep out of) float32.

    Args:
        *targets: Layer classes (subclasses match too) or glob patterns matched
            with ``fnmatch`` against layer paths relative to the model, e.g.
            ``"head/logits"`` or ``"*attention*"`` (``*`` also crosses ``/``).
        exclude: Bool. False (default) adds keep rules; True adds exclusion
            rules, which win over every keep rule, built-in ones included.

    Returns:
        A :class:`Registration`; use it as a context manager to undo on exit.

    Raises:
        ValueError: (project template) a target is neither a Layer subclass nor a
            non-empty string.

    Example:
        >>> import tfmp, keras
        >>> with tfmp.register_float32(keras.layers.Dense):
        ...     keras.layers.Dense in tfmp.float32_layers().keep
        True
    """
    table = _exclude if exclude else _keep
    added = [t for t in targets_from("targets", targets) if t not in table]
    table.extend(added)
    return Registration(added, exclude)


def unregister_float32(*targets: Target) -> None:
    """Removes targets added by :func:`register_float32` (keep or exclude).

    Raises:
        ValueError: (project template) a target was never registered; the message
            lists the registered ones.
    """
    for target in targets_from("targets", targets):
        if target not in _keep and target not in _exclude:
            registered = [_describe(t) for t in _keep + _exclude]
            raise invalid_argument(
                "targets",
                target,
                f"a registered target, one of {registered or 'none (registry is empty)'}",
                choices=[t for t in registered if isinstance(t, str)],
            )
        for table in (_keep, _exclude):
            if target in table:
                table.remove(target)


def float32_layers() -> Float32Rules:
    """Returns the rules in force: built-in classes, user keep and exclude targets."""
    return Float32Rules(BUILTIN_CLASSES, tuple(_keep), tuple(_exclude))


def _describe(target: Target) -> str:
    return target if isinstance(target, str) else target.__name__


def matches(layer: keras.layers.Layer, path: str, targets: Iterable[Target]) -> bool:
    """True when ``layer`` is an instance of a target class or its path matches."""
    for target in targets:
        if isinstance(target, str):
            if fnmatch.fnmatchcase(path, target):
                return True
        elif isinstance(layer, target):
            return True
    return False


def activation_name(layer: keras.layers.Layer) -> str:
    """Name of the layer's activation function (``""`` when it has none)."""
    return getattr(getattr(layer, "activation", None), "__name__", "") or ""


def builtin_reason(layer: keras.layers.Layer) -> Optional[str]:
    """Why a built-in rule keeps ``layer`` in float32, or None.

    Returns:
        ``"softmax"``, ``"normalization"`` or ``"fused <activation>"``, or None.
    """
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    if isinstance(layer, BUILTIN_CLASSES):
        return "normalization"
    name = activation_name(layer)
    if name in SOFTMAX_ACTIVATIONS:
        return "softmax" if isinstance(layer, keras.layers.Activation) else f"fused {name}"
    return None


def decide(
    layer: keras.layers.Layer,
    path: str,
    *,
    is_output: bool,
    keep: Tuple[Target, ...] = (),
    exclude: Tuple[Target, ...] = (),
) -> Optional[str]:
    """Reason to keep ``layer`` in float32 under all rules, or None.

    Order: any exclusion (call or registry) wins; then output position; then
    built-in rules; then user keep targets (call or registry).
    """
    if matches(layer, path, exclude + tuple(_exclude)):
        return None
    if is_output:
        return "output"
    reason = builtin_reason(layer)
    if reason:
        return reason
    if matches(layer, path, keep + tuple(_keep)):
        return "user"
    return None


def is_excluded(layer: keras.layers.Layer, path: str, exclude: Tuple[Target, ...]) -> bool:
    """True when a call-level or registered exclusion matches ``layer``."""
    return matches(layer, path, exclude + tuple(_exclude))
