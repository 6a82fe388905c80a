"""Which layers tfmp keeps in float32: built-in rules, two tables of Keras layers, user rules.

`builtin_reason` covers layers whose numbers 16 bits cannot hold; `FLOAT32_INSIDE_KERAS`
(left 16-bit) and `KNOWN_BROKEN` (forced) name Keras layers by the class whose ``call``
runs, with the version read. Users add targets with :func:`register_float32`
(``exclude=True`` opts out; exclusion wins) until :func:`unregister_float32`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable, List, Optional, Tuple, Type, Union

import keras

from tfmp._src.errors import check_bool, check_type, invalid_argument
from tfmp._src.float32 import pooling3d as _pooling3d
from tfmp._src.float32 import reductions as _reductions
from tfmp._src.float32 import unsafe_ops as _unsafe_ops
from tfmp._src.float32.logits import LOGITS_16BIT, LOGITS_CAST
from tfmp._src.keras_hooks.layer_calls import child_layers
from tfmp._src.keras_hooks.versions import keras_at_least

Target = Union[Type[keras.layers.Layer], str]


@dataclasses.dataclass(frozen=True)
class KerasLayerNote:
    """One Keras layer class whose mixed-precision behaviour tfmp knows.

    Attributes:
        class_path: String. ``module.ClassName`` of the class defining the ``call``
            that runs, e.g. ``"keras.src.applications.convnext.StochasticDepth"``.
        keras_version: String. The first version of `package` whose source does
            this; on an older Keras the note does not apply.
        why: String. What that source does with 16-bit inputs.
        package: String. ``"keras"`` (default) or ``"keras-hub"``; never imported,
            a note matches by `class_path` alone.
    """

    class_path: str
    keras_version: str
    why: str
    package: str = "keras"


#: Layers Keras already computes in float32 for 16-bit inputs: left in the 16-bit policy.
FLOAT32_INSIDE_KERAS: Tuple[KerasLayerNote, ...] = (
    KerasLayerNote(
        "keras.src.layers.normalization.batch_normalization.BatchNormalization", "3.12",
        "call() casts 16-bit inputs to float32 ('BN is prone to overflow'), casts back"),
    KerasLayerNote(
        "keras.src.layers.normalization.layer_normalization.LayerNormalization", "3.12",
        "ops.layer_normalization computes in at least float32, casts back"),
    KerasLayerNote(
        "keras.src.layers.normalization.group_normalization.GroupNormalization", "3.15",
        "autocast=False and _apply_normalization casts 16-bit inputs to float32, casts back "
        "(Keras 3.12-3.14 autocast float32 inputs to 16 bits first)"),
    KerasLayerNote(
        "keras.src.layers.normalization.rms_normalization.RMSNormalization", "3.12",
        "ops.rms_normalization computes in at least float32, casts back"),
)

#: Layers that fail under any mixed policy in plain Keras: forced to float32.
KNOWN_BROKEN: Tuple[KerasLayerNote, ...] = (
    KerasLayerNote(
        "keras.src.applications.convnext.StochasticDepth", "3.15",
        "float32 random noise times the 16-bit input"),
    KerasLayerNote(
        "keras.src.layers.preprocessing.stft_spectrogram.STFTSpectrogram", "3.12",
        "call() accepts float16, float32 or float64 inputs: a bfloat16 one raises TypeError"),
    KerasLayerNote(
        "keras.src.layers.preprocessing.mel_spectrogram.MelSpectrogram", "3.12",
        "its float32 STFT takes the signal autocast to 16 bits (bfloat16: bins up to 10.5 dB off)"),
    KerasLayerNote(
        "keras.src.layers.normalization.spectral_normalization.SpectralNormalization", "3.12",
        "the power iteration and kernel / sigma run in 16 bits and are written back to the float32 "
        "kernel every training step"),
    KerasLayerNote(
        "keras_hub.src.layers.modeling.sine_position_encoding.SinePositionEncoding", "0.32",
        "positions and angles in the compute dtype (bfloat16: positions >= 256 collide, "
        "error up to 1.99)", package="keras-hub"),
)
#: Why a ``Dot(normalize=True)`` is kept in float32: its inputs' squared norm leaves float16's range.
COSINE = "cosine (Dot normalize=True)"

#: Preprocessing layers whose result is exact in float32 and wrong in 16 bits: forced.
EXACT_PREPROCESSING: Tuple[KerasLayerNote, ...] = (
    KerasLayerNote(
        "keras.src.layers.preprocessing.discretization.Discretization", "3.12",
        "digitize() of inputs cast to the compute dtype (tensorflow#43502: values near "
        "1,000 fall in the wrong one of 256 buckets)"),
    KerasLayerNote(
        "keras.src.layers.preprocessing.category_encoding.CategoryEncoding", "3.12",
        "integer ids cast to the compute dtype in a traced call (keras#19583: id 1999 "
        "encoded as 2000 under bfloat16)"),
    KerasLayerNote(
        "keras.src.layers.preprocessing.normalization.Normalization", "3.12",
        "inputs, mean and variance cast to the compute dtype (keras-core#412: 10000.3 "
        "becomes 10048 under bfloat16)"),
)
#: Layers taking a softmax of their own scores, with no Softmax sublayer: forced whole (tensorflow#46064).
SOFTMAX_INSIDE: Tuple[type, ...] = (keras.layers.Attention, keras.layers.AdditiveAttention)
BUILTIN_CLASSES: Tuple[type, ...] = (
    keras.layers.Softmax, keras.layers.UnitNormalization, *SOFTMAX_INSIDE)
#: The reason `tfmp.audit` shows for an `EXACT_PREPROCESSING` layer.
EXACT = "exact preprocessing"
#: Why an output-producing block keeps its 16-bit policy and returns float32 (`decide`).
OUTPUT_CAST = "output cast to float32 (body 16-bit)"
#: Reasons of output producers that keep their 16-bit policy: only their outputs are cast.
CAST_ONLY = (OUTPUT_CAST, LOGITS_CAST)
#: Reasons of output producers that keep their 16-bit policy (a chunked loss's logits: not even cast).
KEPT_16BIT = (*CAST_ONLY, LOGITS_16BIT)

_keep: List[Target] = []
_exclude: List[Target] = []


@dataclasses.dataclass(frozen=True)
class Float32Rules:
    """Snapshot of the float32 rules in force, returned by :func:`float32_layers`.

    Attributes:
        builtin: Tuple of layer classes tfmp always keeps in float32.
        keep: Tuple of user-registered classes or path patterns to keep.
        exclude: Tuple of user-registered classes or path patterns never forced.
        known_broken: Tuple of `KerasLayerNote`: forced, they fail under mixed policies.
        float32_inside_keras: Tuple of `KerasLayerNote`: left 16-bit, Keras computes them in float32.
        exact_preprocessing: Tuple of `KerasLayerNote`: forced, their result must be exact.
    """

    builtin: Tuple[type, ...]
    keep: Tuple[Target, ...]
    exclude: Tuple[Target, ...]
    known_broken: Tuple[KerasLayerNote, ...] = KNOWN_BROKEN
    float32_inside_keras: Tuple[KerasLayerNote, ...] = FLOAT32_INSIDE_KERAS
    exact_preprocessing: Tuple[KerasLayerNote, ...] = EXACT_PREPROCESSING

    def __post_init__(self) -> None:
        """Checks the fields' forms, so a snapshot made by hand fails here.

        Raises:
            ValueError: a field is not a tuple of what its attribute lists.
        """
        check_type("builtin", self.builtin, tuple, "a tuple of keras.layers.Layer classes", items=type,
                   fix="Pass e.g. builtin=(keras.layers.Softmax,), or take the rules from tfmp.float32_layers().")
        for name in ("keep", "exclude"):
            check_type(name, getattr(self, name), tuple, "a tuple of Layer classes and pattern strings",
                       fix=f"Pass e.g. {name}=('head/*', keras.layers.Dense), or {name}=() for none.")
            targets_from(name, getattr(self, name))
        for name in ("known_broken", "float32_inside_keras", "exact_preprocessing"):
            check_type(name, getattr(self, name), tuple, "a tuple of KerasLayerNote", items=KerasLayerNote,
                       fix=f"Leave {name} out (its default is tfmp's table), or pass {name}=() for none.")


class Registration:
    """Handle returned by :func:`register_float32`; a ``with`` block undoes it.

    On exit it removes exactly the targets this call added; earlier ones stay.
    """

    def __init__(self, added: List[Target], exclude: bool) -> None:
        """Made by `register_float32`.

        Args:
            added: List or tuple of targets (classes, patterns) this call added.
            exclude: Bool. Whether they were added as exclusions.

        Raises:
            ValueError: `added` is not a list or tuple of targets, or `exclude` not a bool.
        """
        check_type("added", added, (list, tuple), "a list of Layer classes and pattern strings",
                   fix="Pass e.g. added=['head/*']; tfmp.register_float32('head/*') makes one for you.")
        targets_from("added", added)
        check_bool("exclude", exclude)
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
    """Validates a ``keep``/``exclude`` style argument `name` (a class, a pattern, or a collection) into a tuple.

    Raises:
        ValueError: `targets` is None (``()`` means none), or an element is
            neither a ``keras.layers.Layer`` subclass nor a non-empty string.
    """
    if targets is None:
        raise invalid_argument(
            name, targets, "a Layer class, a pattern string, or a list of them",
            fix=f"Pass {name}=() for no targets.",
        )
    if not isinstance(targets, (list, tuple, set, frozenset)):
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

    A registered target applies to every model forced from now on, so it is not
    checked per model (`tfmp.UnmatchedTargetWarning`).

    Returns:
        A :class:`Registration`; use it as a context manager to undo on exit.

    Raises:
        ValueError: no target given, a target is neither a Layer subclass nor a
            non-empty string (unpack a list: ``register_float32(*targets)``), or
            `exclude` is not a bool.

    Example:
        >>> import tfmp, keras
        >>> with tfmp.register_float32(keras.layers.Dense):
        ...     keras.layers.Dense in tfmp.float32_layers().keep
        True
    """
    check_bool("exclude", exclude)
    _check_some("register_float32", targets)
    table = _exclude if exclude else _keep
    added = [t for t in targets_from("targets", targets) if t not in table]
    table.extend(added)
    return Registration(added, exclude)


def unregister_float32(*targets: Target) -> None:
    """Removes targets added by :func:`register_float32` (keep or exclude).

    Raises:
        ValueError: no target given, a target is neither a Layer subclass nor a
            non-empty string, or was never registered (the message lists those registered).
    """
    _check_some("unregister_float32", targets)
    for target in targets_from("targets", targets):
        if target not in _keep and target not in _exclude:
            registered = [t if isinstance(t, str) else t.__name__ for t in _keep + _exclude]
            raise invalid_argument(
                "targets",
                target,
                f"a registered target, one of {registered or 'none (registry is empty)'}",
                choices=[t for t in registered if isinstance(t, str)],
                fix="Pass a target given to tfmp.register_float32 before, as given there; "
                "tfmp.float32_layers() lists them.",
            )
        for table in (_keep, _exclude):
            if target in table:
                table.remove(target)


def _check_some(function: str, targets: Tuple[Target, ...]) -> None:
    """Refuses a call of `function` without targets: it would change nothing."""
    if not targets:
        raise invalid_argument(
            "targets", targets, "at least one Layer class or pattern string",
            fix=f"Pass the targets themselves, e.g. tfmp.{function}('head/*').",
        )


def float32_layers() -> Float32Rules:
    """Returns the rules in force: built-in classes, user keep and exclude targets."""
    return Float32Rules(BUILTIN_CLASSES, tuple(_keep), tuple(_exclude))


def matches(layer: keras.layers.Layer, path: str, targets: Iterable[Target]) -> bool:
    """True when ``layer`` is an instance of a target class or its path matches."""
    return any(fnmatch.fnmatchcase(path, target) if isinstance(target, str) else isinstance(layer, target)
               for target in targets)


def _call_class_path(layer: keras.layers.Layer) -> str:
    """``module.ClassName`` of the class in ``type(layer).__mro__`` that defines ``call``."""
    for klass in type(layer).__mro__:
        if "call" in vars(klass):
            return f"{klass.__module__}.{klass.__qualname__}"
    return ""


def note_for_path(class_path: str, table: Tuple[KerasLayerNote, ...]) -> Optional[KerasLayerNote]:
    """The note of `table` whose ``class_path`` is `class_path` (``"module.ClassName"``), or None."""
    return next((note for note in table if note.class_path == class_path), None)


def _note(layer: keras.layers.Layer, table: Tuple[KerasLayerNote, ...]) -> Optional[KerasLayerNote]:
    return note_for_path(_call_class_path(layer), table)


def exact_reason(layer: keras.layers.Layer) -> Optional[str]:
    """``"exact preprocessing"`` for an `EXACT_PREPROCESSING` layer, else None."""
    return EXACT if _note(layer, EXACT_PREPROCESSING) is not None else None


def keras_float32_reason(layer: keras.layers.Layer) -> Optional[str]:
    """``"float32 inside Keras <version>"`` for a `FLOAT32_INSIDE_KERAS` layer, else None."""
    note = _note(layer, FLOAT32_INSIDE_KERAS)
    if note is None or not keras_at_least(note.keras_version):
        return None
    return f"float32 inside Keras >= {note.keras_version}"


def builtin_reason(layer: keras.layers.Layer) -> Optional[str]:
    """Why a built-in rule keeps ``layer`` in float32 (``"softmax"``, ``"known fix: <why>"``...), or None."""
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    if exact_reason(layer):
        return EXACT
    note = _note(layer, KNOWN_BROKEN)
    if note is not None:
        return f"known fix: {note.why}"
    if isinstance(layer, SOFTMAX_INSIDE):
        return "softmax inside"
    if isinstance(layer, keras.layers.Dot) and layer.normalize:
        return COSINE
    pooling = _pooling3d.reason(layer)
    if pooling:
        return pooling
    if isinstance(layer, BUILTIN_CLASSES):
        return "normalization"
    if _note(layer, FLOAT32_INSIDE_KERAS) is not None and keras_float32_reason(layer) is None:
        return "normalization"  # listed, but this Keras is older than the note's version
    name = getattr(getattr(layer, "activation", None), "__name__", "") or ""
    if name in ("softmax", "log_softmax"):
        return "softmax" if isinstance(layer, keras.layers.Activation) else f"fused {name}"
    return _reductions.reason(layer) or _unsafe_ops.reason(layer)


def decide(
    layer: keras.layers.Layer,
    path: str,
    *,
    is_output: bool,
    keep: Tuple[Target, ...] = (),
    exclude: Tuple[Target, ...] = (),
    logits: bool = False,
    chunked: bool = False,
) -> Optional[str]:
    """Reason to keep ``layer`` in float32 (exclusion, output, built-in, keep rules, in that order), or None.

    An output-producing custom block or logits layer gets `OUTPUT_CAST` / `LOGITS_CAST` unless a rule selects it;
    a logits layer feeding only chunked cross-entropies (``chunked``) `LOGITS_16BIT`.
    """
    if is_excluded(layer, path, exclude):
        return None
    # A custom block: sublayers, and a call that is not Keras's (MultiHeadAttention or an RNN is one computation).
    block = bool(child_layers(layer)) and not _call_class_path(layer).startswith("keras.")
    if is_output and not block and not logits:
        return "output"
    reason = builtin_reason(layer)
    if not reason and matches(layer, path, keep + tuple(_keep)):
        reason = "user rule"
    if is_output:
        return "output" if reason else (OUTPUT_CAST if block else LOGITS_16BIT if chunked else LOGITS_CAST)
    return reason


def is_excluded(layer: keras.layers.Layer, path: str, exclude: Tuple[Target, ...]) -> bool:
    """True when a call-level or registered exclusion matches ``layer``."""
    return matches(layer, path, exclude + tuple(_exclude))
