"""The attachment record: what tfmp decided for a model, kept on the model and its layers.

Each attached object carries the same `Attachment` in its own ``__dict__`` (`PerObject`: it dies
with the model, neither tracked nor saved). The model-level hooks read only this mark, never the
thread's session; a layer without one takes its model's, or attaches at first use (`attached_or_first_use`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional

from tfmp._src.errors import check_bool, check_type, invalid_argument
from tfmp._src.keras_hooks.layer_calls import entry_layer
from tfmp._src.keras_hooks.object_state import PerObject
from tfmp._src.policy import session, speedups

_MARK = PerObject("attachment")
#: What `tfmp.detach` took the mark off (kept off the object, which detach leaves as Keras made it).
_DETACHED: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: Objects that carry a mark, and those of them attached at their first call (which keep
#: the model-level hooks on, `tfmp._src.attachment.hooks`).
_marked: "weakref.WeakSet[Any]" = weakref.WeakSet()
_first_call: "weakref.WeakSet[Any]" = weakref.WeakSet()
_lock = threading.RLock()


@dataclasses.dataclass
class Attachment:
    """What tfmp decided for one model when it attached it (`tfmp.attachment(model)`).

    Decided once, when the model is compiled or loaded while tfmp is enabled (or, for a layer of a
    model never compiled under tfmp, at its first call while enabled), and kept until `tfmp.detach`:
    the same graph is traced inside or outside `tfmp.policy_scope`, after `tfmp.disable()`, in
    `tf.distribute` replica threads and in a `tf.function` of the user's.

    Attributes:
        model: String. Name of the model (or layer) attached.
        attached_by: String. ``"compile"``, ``"load"`` (Keras compiled it while loading it) or
            ``"first call"`` (a layer called while enabled).
        policy: String. tfmp's policy in the session that attached it, e.g. ``"mixed_bfloat16"``.
        layer_policies: Dict, layer path -> dtype policy name at attachment.
        forced_float32: Dict, layer path -> why tfmp set it to float32 (``"output"``, ``"softmax"``...).
        batchnorm_kernel: Dict, BatchNormalization path -> ``"fused"`` or ``"keras: <reason>"``.
        exact_ids: Int. Embedding layers whose float token ids are looked up as given.
        explains_dtype_errors: Bool. Dtype mismatches in the model's ``build``/``call`` name the layer and fix.
        check_numerics: Bool. `tfmp.check_numerics` was installed (``debug``).
        loss_terms_in_float32: Bool. ``model.losses`` hands back 16-bit terms cast to float32 (always True).
        custom_optimizers: List of strings. Attributes of the model besides ``optimizer`` whose optimizer
            tfmp wrapped in a `tfmp.LossScaleOptimizer` (a custom ``compile``'s, e.g. ``["d_optimizer"]``).
        remapper: String. ``"on"``: the model's functions run with Grappler's remapper as configured;
            ``"off: <why>"``: without it (calling thread only, and inside `tfmp.step_scope`), for a
            float16 model on a CPU where oneDNN's fused float16 matmul crawls.
        gelu: String. ``"keras"``: Keras's exact GELU as it is (a float32 model, a GPU or TPU, a layer
            attached at its first call); ``"float32 inside: <why>"``: the bfloat16 exact GELU computed
            in float32 and rounded once, as on every CPU.
        bias_gradient: String. ``"keras"``: Keras's bias gradients (a float32 model, a GPU or TPU);
            ``"summed: <check>"``: 16-bit Dense and convolution bias gradients summed with float32
            accumulation, because this CPU's ``BiasAddGrad`` lost a known sum; ``"summed except after
            Conv2D: <check>"``: the same but a trainable Conv2D keeps oneDNN's fused kernel, which kept
            it; ``"keras: <check>"``: checked, not lost.
        conv: String. ``"keras"``: Keras's convolutions (not float16, a GPU or TPU, a layer attached at
            its first call); ``"float32 inside: <why>"``: float16 Conv1D/2D/3D, their transposes and
            SeparableConv1D/2D computed in float32 and rounded once, as on every CPU.
        depthwise_conv: String. ``"keras"``: Keras's depthwise convolutions, as for `conv`;
            ``"float32 inside: <why>"``: float16 DepthwiseConv1D/2D computed in float32 and rounded
            once, on a CPU whose TensorFlow oneDNN takes float16 (``DeviceFacts.onednn_float16``);
            ``"keras: <why>"``: kept on any other CPU (TensorFlow's float16 kernel there is Eigen's).
        dropout: String. ``"keras"``: Keras's dropout (a float32 model, a layer attached at its first
            call); ``"exact draw: <why>"``: a 16-bit model's ``Dropout``, ``SpatialDropout*`` and
            ``keras.random.dropout`` decide each value on 16 random bits (the rate to within 2**-17),
            scale in float32 and round the output once to the 16-bit dtype, so they drop their rate.
        cross_entropy: String. ``"keras"``: Keras's sparse cross-entropy as it is (a float32 model, a GPU
            or TPU); ``"float32 inside: <why>"``: a bfloat16 model's from-logits sparse cross-entropy,
            in its train and test steps, read from the 16-bit logits Keras would cast to float32, in
            two fused float32 passes with the gradient rounded once (``float32/cross_entropy.py``).
        speedups: Dict, speed feature -> ``"on"`` or ``"off (<why>)"``: the switch
            (``tfmp.enable(speedups=...)``), a moved Keras surface, or a GPU or TPU (none measured). A
            feature on still applies only where its own field says so.
        optimizer: String. What tfmp did with the model's optimizer: ``"tfmp.LossScaleOptimizer(Adam):
            dynamic loss scale, guard='auto', fused updates on"``, ``"Adam: kept (float32 compute)"``,
            ``"Adam: as saved"`` (loaded), or ``""`` (none).
        activity_regularizers_in_float32: List of strings. Paths of the 16-bit layers whose activity
            regularizer runs on the output cast to float32 (``0.01 * sum(x**2)`` overflows float16's 65504).
        subscriptions: Dict, object (``"model"``, a layer path, ``"<path>.dtype_policy"``,
            ``"optimizer"``) -> list of ``"<surface>: <method> (<subscriber>)"``: every hook on the
            model's own objects, read anew by each `tfmp.attachment(model)`. Class and module hooks,
            shared by every model, are in the architecture notes.
    """

    model: str
    attached_by: str
    policy: str
    layer_policies: Dict[str, str] = dataclasses.field(default_factory=dict)
    forced_float32: Dict[str, str] = dataclasses.field(default_factory=dict)
    batchnorm_kernel: Dict[str, str] = dataclasses.field(default_factory=dict)
    exact_ids: int = 0
    explains_dtype_errors: bool = False
    check_numerics: bool = False
    loss_terms_in_float32: bool = True
    custom_optimizers: List[str] = dataclasses.field(default_factory=list)
    remapper: str = "on"
    gelu: str = "keras"
    bias_gradient: str = "keras"
    conv: str = "keras"
    depthwise_conv: str = "keras"
    dropout: str = "keras"
    cross_entropy: str = "keras"
    speedups: Dict[str, str] = dataclasses.field(default_factory=lambda: speedups.decided(None))
    optimizer: str = ""
    activity_regularizers_in_float32: List[str] = dataclasses.field(default_factory=list)
    subscriptions: Dict[str, List[str]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises ValueError (template) for a field of another type than documented."""
        for name, example in (("model", "'sequential'"), ("attached_by", "'compile'"),
                              ("policy", "'mixed_float16'"), ("remapper", "'on'"),
                              ("gelu", "'keras'"), ("bias_gradient", "'keras'"), ("conv", "'keras'"),
                              ("depthwise_conv", "'keras'"), ("dropout", "'keras'"), ("cross_entropy", "'keras'"),
                              ("optimizer", "'Adam: kept (float32 compute)'")):
            check_type(name, getattr(self, name), str, "a string", fix=f"Pass e.g. {name}={example}.")
        for name in ("layer_policies", "forced_float32", "batchnorm_kernel", "speedups"):
            check_type(name, getattr(self, name), dict, "a dict of layer path -> string", items=str,
                       fix=f"Pass e.g. {name}={{'dense': 'float32'}}, or {{}} for none.")
        count_fix = "Pass the number of Embedding layers with exact ids, e.g. exact_ids=0."
        check_type("exact_ids", self.exact_ids, int, "an int >= 0", fix=count_fix)
        if self.exact_ids < 0:
            raise invalid_argument("exact_ids", self.exact_ids, "an int >= 0", fix=count_fix)
        for name in ("explains_dtype_errors", "check_numerics", "loss_terms_in_float32"):
            check_bool(name, getattr(self, name))
        for name in ("custom_optimizers", "activity_regularizers_in_float32"):
            check_type(name, getattr(self, name), list, "a list of strings", items=str,
                       fix=f"Pass e.g. {name}=['dense'], or [] for none.")
        check_type("subscriptions", self.subscriptions, dict, "a dict of object -> list of strings",
                   items=list, fix="Pass e.g. subscriptions={'model': ['trainer: fit (fit_lifecycle)']}, "
                   "or {} for none.")


_stepping = threading.local()  # .models: the models whose steps this thread traces, innermost last


@contextlib.contextmanager
def stepping(model: Any) -> Iterator[None]:
    """Marks `model` as the model whose train, test or predict step this thread traces inside the block."""
    models = _stepping.__dict__.setdefault("models", [])
    models.append(model)
    try:
        yield
    finally:
        models.pop()


def of_stepping() -> Optional[Attachment]:
    """The `Attachment` of the model whose step this thread traces (innermost `stepping`), or None."""
    models = getattr(_stepping, "models", None)
    return of(models[-1]) if models else None


def of(obj: Any) -> Optional[Attachment]:
    """The `Attachment` `obj` (a model or layer) carries, or None."""
    return _MARK.get(obj) if hasattr(obj, "__dict__") else None


def mark(objects: Iterable[Any], record: Attachment) -> None:
    """Gives each of `objects` the mark `record`."""
    with _lock:
        for obj in objects:
            _MARK[obj] = record
            _DETACHED.discard(obj)
            _marked.add(obj)
            if record.attached_by == "first call":
                _first_call.add(obj)
            else:
                _first_call.discard(obj)


def unmark(objects: Iterable[Any], *, detached: bool = False) -> None:
    """Takes the mark off each of `objects`; `detached` ones stay unmarked until `mark` (no first-use attach)."""
    with _lock:
        for obj in objects:
            _MARK.pop(obj, None)
            _marked.discard(obj)
            _first_call.discard(obj)
            if detached:
                _DETACHED.add(obj)


def detached(obj: Any) -> bool:
    """Bool. `tfmp.detach` took `obj`'s mark off, and no compile or load under tfmp gave one back."""
    with _lock:
        return obj in _DETACHED


def any_marked() -> bool:
    """Bool. Whether an object with a mark is still alive (not yet garbage-collected)."""
    with _lock:
        return len(_marked) > 0


def any_attached_at_first_call() -> bool:
    """Bool. Whether an object attached at its first call (not by compile or load) is alive."""
    with _lock:
        return len(_first_call) > 0


def marked_objects() -> List[Any]:
    """The live objects (models and layers) that carry a mark."""
    with _lock:
        return list(_marked)


def attached_or_first_use(layer: Any) -> bool:
    """Bool. Whether tfmp treats `layer` as attached, attaching it on first use (the decision stays).

    A marked layer is; a detached one is not; one called inside an attached model's call takes its
    mark; one of a model compiled without tfmp is not; any other is attached when the thread has a
    session (a custom loop over a model built while enabled, never compiled).
    """
    if of(layer) is not None:
        return True
    if layer in _DETACHED:
        return False
    entry = entry_layer()
    inherited = of(entry) if entry is not None else None
    if inherited is not None:
        mark([layer], inherited)
        return True
    current = session.current()
    if current is None or any(getattr(obj, "compiled", False) for obj in (layer, entry)):
        return False
    mark([layer], Attachment(model=layer.name, attached_by="first call", policy=current.decision.policy,
                             speedups=speedups.decided(current.speedups)))
    return True


def of_calling(layer: Any) -> Optional[Attachment]:
    """The `Attachment` the calling `layer` (`layer_calls.calling_layer`, maybe None) computes under, or None."""
    if layer is None or not attached_or_first_use(layer):
        return None
    return of(layer)


def would_attach(layer: Any) -> bool:
    """Bool. `attached_or_first_use` without attaching: for reports (`tfmp.audit`)."""
    return of(layer) is not None or session.current() is not None
