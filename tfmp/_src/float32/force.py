"""`tfmp.force_float32`: compute precision-sensitive layers and model outputs in float32.

Sets a float32 policy on the layers `registry` selects and on the model's output
layers, then brings the symbolic graph's dtypes in line (:func:`_refresh_graph`).
A forced layer hands back its parent's dtype (`cast_back`); output layers return float32.
"""

from __future__ import annotations

import functools
import weakref
from typing import Dict, List, Optional, Set, Tuple

import keras

from tfmp._src.constants import LOW_PRECISION
from tfmp._src.errors import check_model, warn
from tfmp._src.float32 import cast_back as _cast_back
from tfmp._src.float32 import exact_layers as _exact
from tfmp._src.float32 import pooling3d as _pooling3d
from tfmp._src.float32 import reductions as _reductions
from tfmp._src.float32 import registry as _registry
from tfmp._src.float32 import unmatched as _unmatched
from tfmp._src.float32 import unsafe_ops as _unsafe_ops
from tfmp._src.float32.cast_back import casts_back
from tfmp._src.float32.logits import LOGITS_16BIT, chunked, logits_layers, projects, reverse_call
from tfmp._src.keras_hooks import layer_calls
from tfmp._src.keras_hooks.object_state import PerObject
from tfmp._src.keras_hooks.functional_graph import (
    functional_graph,
    inbound_node,
    keras_history,
    nodes_by_depth,
    set_symbolic_dtype,
)
from tfmp._src.keras_hooks.layer_calls import autocasts_inputs
from tfmp._src.layer_tree import walk

_FORCED: "weakref.WeakKeyDictionary[keras.layers.Layer, str]" = weakref.WeakKeyDictionary()
#: Layers a user exclusion kept out of float32 (`excluded_by_user`).
_EXCLUDED: "weakref.WeakSet[keras.layers.Layer]" = weakref.WeakSet()
#: Unbuilt layers whose ``build`` is hooked: layer -> [hook, (path, keep, exclude, forced_as)].
_DEFERRED = PerObject("deferred_forcing")


def forced_reason(layer: keras.layers.Layer) -> Optional[str]:
    """Why tfmp set ``layer`` to float32 (``"output"``, ``"softmax"``...), or None."""
    reason = _FORCED.get(layer)
    if reason is None and _exact.forced_when_created(layer):
        return _registry.EXACT
    return reason


def excluded_by_user(layer: keras.layers.Layer) -> bool:
    """True when an exclusion kept ``layer`` out of float32 when tfmp last forced its model."""
    return layer in _EXCLUDED


def output_producers(model: keras.Model) -> Tuple[List[keras.layers.Layer], List[keras.Model]]:
    """``(layers, subclassed)``: the layers computing ``model``'s outputs (through raw ops and nested
    models), and the models with no graph to walk, whose outputs must be cast instead."""
    graph = functional_graph(model)
    if graph is None:
        if isinstance(model, keras.Sequential) and model.layers:
            last = model.layers[-1]
            if isinstance(last, keras.Model):
                return output_producers(last)
            return [last], []
        return [], [model]
    layers: List[keras.layers.Layer] = []
    subclassed: List[keras.Model] = []
    stack, seen = list(graph.outputs), set()
    while stack:
        tensor = stack.pop()
        history = keras_history(tensor)
        if history is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        op = history.operation
        if op is None or isinstance(op, keras.layers.InputLayer):
            continue
        if isinstance(op, keras.Model):
            inner_layers, inner_subclassed = output_producers(op)
            layers += inner_layers
            subclassed += inner_subclassed
        elif isinstance(op, keras.layers.Layer):
            layers.append(op)
        else:  # A raw op such as keras.ops.add: look at what feeds it.
            stack.extend(inbound_node(op, history.node_index).input_tensors)
    return layers, subclassed


def _saved_float32(layer: keras.layers.Layer, parent) -> bool:
    """True when a loaded ``layer`` has float32 under a 16-bit or forced parent, as forcing left it.

    A model counts as 16-bit when any of its layers is: Keras gives a model loaded under a float32
    session that policy, while its layers keep the ones saved with them.
    """
    if layer in _FORCED or layer.dtype_policy.name != "float32":
        return False
    if getattr(parent, "compute_dtype", None) in LOW_PRECISION or parent in _FORCED:
        return True
    return isinstance(parent, keras.Model) and any(e.layer.compute_dtype in LOW_PRECISION for e in walk(parent))


def _set_float32(layer: keras.layers.Layer, reason: str, parent=None, adopt: bool = False) -> bool:
    """Sets a float32 policy on a 16-bit float layer; True when it changed.

    With ``adopt`` (loading), a layer saved as forcing left it is recorded as forced and gets its hook again.
    """
    changed = True
    if adopt and _saved_float32(layer, parent):
        changed = reason != "output" or projects(layer)  # the rebuilt graph lacks the hook
    elif reason == "output" and casts_back(layer) and not projects(layer):
        _cast_back.remove(layer)
        _FORCED[layer] = reason
        return True
    elif layer in _FORCED or not (_exact.forced_when_created(layer)  # else float32 since made
                                   or _unsafe_ops.forced_at_build(layer)):  # or since its first build
        if layer.compute_dtype not in LOW_PRECISION or layer.dtype_policy.quantization_mode:
            return False
        layer.dtype_policy = "float32"
        _exact.refresh_state(layer)
    _FORCED[layer] = reason
    if reason != "output":  # hands back the parent's dtype
        _cast_back.install(layer, parent)
    elif projects(layer):  # a tied embedding producing an output casts back only its lookups
        _cast_back.install(layer, parent, only=lambda args, kwargs: not reverse_call(args, kwargs))
    return changed


def _apply_rules(
    entries, outputs: Set[int], keep, exclude, inherited: Dict[int, str], adopt: bool = False,
    logits: Set[int] = frozenset(), chunked_logits: Set[int] = frozenset(),
) -> Set[int]:
    """Forces every ``(path, layer, parent)`` entry some rule selects; returns ids of changed layers.

    ``inherited`` (layer id -> path of the forced layer it sits in) is updated so sublayers follow.
    """
    for path, layer, _ in entries:  # before changing anything
        if layer.compute_dtype == "float16" and _pooling3d.reason(layer) and \
                _registry.is_excluded(layer, path, exclude):
            raise _pooling3d.excluded_error(path, layer)
    changed: Set[int] = set()
    for path, layer, parent in entries:
        if _registry.is_excluded(layer, path, exclude):
            _EXCLUDED.add(layer)
            if layer not in _FORCED and _exact.unforce(layer):
                changed.add(id(layer))
            continue
        _EXCLUDED.discard(layer)
        reason = _registry.decide(
            layer, path, is_output=id(layer) in outputs, keep=keep, exclude=exclude,
            logits=id(layer) in logits, chunked=id(layer) in chunked_logits,
        )
        if reason == LOGITS_16BIT:  # 16-bit and handing back 16-bit: the chunked loss computes in float32
            _FORCED[layer] = reason
            continue
        if reason in _registry.CAST_ONLY and layer.compute_dtype not in LOW_PRECISION:
            reason = "output"  # float32 already (forced earlier, or loaded so): stays whole
        if reason in _registry.CAST_ONLY:
            _FORCED[layer] = reason
            if _cast_back.cast_outputs(layer, only=reverse_call if projects(layer) else None):
                changed.add(id(layer))
            continue  # its sublayers follow their own rules
        if reason is not None:
            inherited[id(layer)] = path
        elif id(parent) in inherited and inherited[id(parent)] == path.rpartition("/")[0] and \
                not _reductions.inherits(parent, layer):  # a MoE's expert: 16-bit, handing back float32
            _cast_back.install(layer, parent, dtypes=("float32",))
        elif id(parent) in inherited:
            inherited[id(layer)] = inherited[id(parent)]
            reason = f"inside {inherited[id(parent)]}"
        if reason is not None and _set_float32(layer, reason, parent, adopt):
            changed.add(id(layer))
    for path, layer, _ in entries:
        if not layer.built:
            _defer(layer, path, keep, exclude, inherited.get(id(layer)))
    return changed


def _defer(layer, path: str, keep, exclude, forced_as: Optional[str]) -> None:
    """Re-applies the rules to the sublayers ``layer.build()`` creates (a one-shot ``build`` hook)."""
    pending = _DEFERRED.get(layer)
    if pending is not None:
        pending[1] = (path, keep, exclude, forced_as)
        return
    pending = _DEFERRED[layer] = [None, (path, keep, exclude, forced_as)]

    def wrap(original):
        @functools.wraps(original)
        def build(*args, **kwargs):
            result = original(*args, **kwargs)
            hook, (path, keep, exclude, forced_as) = _DEFERRED.pop(layer, pending)
            hook.remove()
            inherited = {id(layer): forced_as} if forced_as else {}
            _apply_rules(walk(layer, path), set(), keep, exclude, inherited)
            _unmatched.after_build(layer, _DEFERRED)
            return result

        return build

    pending[0] = layer_calls.subscribe(layer, "build", wrap, owner="float32.build")


def _spec_inputs(op, node):
    """The node's recorded arguments, float ones cast as ``Layer.__call__`` would."""
    args, kwargs = node.arguments.args, node.arguments.kwargs
    if not autocasts_inputs(op):
        return args, kwargs
    target = keras.backend.standardize_dtype(op.input_dtype)

    def cast(x):
        if (
            isinstance(x, keras.KerasTensor)
            and keras.backend.is_float_dtype(x.dtype)
            and x.dtype != target
        ):
            return keras.KerasTensor(x.shape, dtype=target, sparse=x.sparse)
        return x

    return keras.tree.map_structure(cast, args), keras.tree.map_structure(cast, kwargs)


def _refresh_graph(graph, changed_ops: Set[int]) -> bool:
    """Recomputes a Functional graph's symbolic dtypes in place; True when an output's changed."""
    changed_tensors: Set[int] = set()
    nodes = nodes_by_depth(graph)
    for depth in sorted(nodes, reverse=True):
        for node in nodes[depth]:
            op = node.operation
            if node.is_input or op is None:
                continue
            inputs_changed = any(id(t) in changed_tensors for t in node.input_tensors)
            casts_inputs = autocasts_inputs(op) and keras.backend.is_float_dtype(op.compute_dtype)
            if id(op) not in changed_ops and not (inputs_changed and not casts_inputs):
                continue
            args, kwargs = _spec_inputs(op, node)
            try:
                spec = op.compute_output_spec(*args, **kwargs)
            except Exception as error:  # Keras may raise anything from tracing `call`.
                first = (str(error).splitlines() or [""])[0]
                warn(f"tfmp could not recompute the symbolic output dtype of layer '{op.name}' ({type(op).__name__}).",
                     f"Its compute_output_spec raised {type(error).__name__}: {first}",
                     "Fix: none needed; its runtime outputs follow its new policy regardless.",
                     UserWarning, section="symbolic-dtypes-not-recomputed")
                continue
            for tensor, new in zip(node.outputs, keras.tree.flatten(spec)):
                new_dtype = keras.backend.standardize_dtype(new.dtype)
                if new_dtype != tensor.dtype:
                    set_symbolic_dtype(tensor, new_dtype)
                    changed_tensors.add(id(tensor))
    return any(id(t) in changed_tensors for t in graph.outputs)


def force_float32(model: keras.Model, *, keep=(), exclude=()) -> keras.Model:
    """Computes precision-sensitive layers in float32 and returns float32 model outputs.

    Sets a float32 ``DTypePolicy`` on: layers producing model outputs (a custom
    block producing one keeps its 16-bit policy, its output cast); Softmax,
    UnitNormalization and fused softmax/log_softmax layers; known-broken Keras
    layers (``registry.KNOWN_BROKEN``); layers whose own float16 ``logsumexp`` or
    sum can exceed 65504, whose 16-bit running sums stall, whose positions round
    together, or whose ``top_k`` ranks 16-bit values (of its sublayers, only
    those making the ranked values) (``tfmp._src.float32.reductions``); ``keep`` and
    registered targets; and all their sublayers. Forced layers but output
    producers hand back their parent's 16-bit dtype. Only float16/bfloat16 layers
    are touched; idempotent; works before or after build. A subclassed model has
    no graph: its ``call`` casts 16-bit outputs to float32. A logits layer is
    forced like any output layer (``compile`` under `tfmp.enable` keeps a
    from-logits one 16-bit, `tfmp._src.float32.logits`).

    Args:
        model: ``keras.Model``. Changed in place.
        keep: Layer class, glob pattern over layer paths (``"head/*"``), or an
            iterable of those. Extra layers to keep in float32.
        exclude: Same forms. Layers never forced, whatever rule selects them.

    Returns:
        The same ``model``; ``tfmp.audit(model)`` shows which layers were forced and why.

    Raises:
        ValueError: ``model`` is not a ``keras.Model`` or has no layer (unbuilt
            layers are forced as they are built); ``keep``/``exclude`` is None
            (``()`` means none) or holds something other than a Layer class or a
            non-empty pattern; or an exclusion matches a float16 3-D pooling
            layer on a machine without GPUs or TPUs, which TensorFlow cannot run
            (`tfmp._src.float32.pooling3d`).

    Warns:
        tfmp.UnmatchedTargetWarning: a ``keep`` or ``exclude`` target matches no
            layer of ``model`` (once per model and target; for layers with a
            ``build`` of their own, once they are built). Targets registered with
            `tfmp.register_float32` are not checked per model.

    Example:
        >>> import keras, tfmp
        >>> keras.config.set_dtype_policy("mixed_float16")
        >>> inputs = keras.Input((784,))
        >>> x = keras.layers.Dense(512, activation="relu")(inputs)
        >>> model = tfmp.force_float32(keras.Model(inputs, keras.layers.Dense(10)(x)))
        >>> model.outputs[0].dtype, model.layers[1].compute_dtype
        ('float32', 'float16')
        >>> keras.config.set_dtype_policy("float32")
    """
    return _checked_force(model, keep, exclude, arguments=("keep", "exclude"))


def force_compiled(model: keras.Model, *, keep=(), exclude=(), loss=None) -> keras.Model:
    """`force_float32` as ``compile()`` under `tfmp.enable` calls it (with its ``loss``); skips a layerless model."""
    if not [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]:
        return model
    return _checked_force(model, keep, exclude, loss, arguments=("keep_float32", "exclude_float32"))


def _checked_force(model: keras.Model, keep, exclude, loss=None, *, arguments) -> keras.Model:
    """`_force` after `force_float32`'s argument checks; ``arguments`` names keep/exclude for warnings."""
    check_model("model", model, expected="a keras.Model (Sequential, Functional or subclassed)",
                fix="Wrap a single layer in keras.Sequential([layer]) first.")
    keep, exclude = _registry.targets_from("keep", keep), _registry.targets_from("exclude", exclude)
    _force(model, keep, exclude, loss=loss)
    _unmatched.check(model, tuple(zip(arguments, (keep, exclude))), walk(model), _DEFERRED)
    return model


def force_loaded(model: keras.Model, *, keep=(), exclude=(), loss=None) -> keras.Model:
    """`force_compiled` for a model Keras is loading: a float32 layer under a 16-bit parent a rule selects is forced."""
    if not any(entry.layer.compute_dtype in LOW_PRECISION for entry in walk(model)):
        return model
    return _force(model, _registry.targets_from("keep", keep),
                  _registry.targets_from("exclude", exclude), adopt=True, loss=loss)


def _force(model: keras.Model, keep, exclude, adopt: bool = False, loss=None) -> keras.Model:
    entries = walk(model)
    producers, subclassed = output_producers(model)
    changed = _apply_rules(entries, {id(x) for x in producers}, keep, exclude, {}, adopt,
                           logits_layers(model, loss), logits_layers(model, loss, chunked))
    if not model.built and not functional_graph(model):
        _defer(model, "", keep, exclude, None)
    for sub in subclassed:
        if _cast_back.cast_outputs(sub):
            _FORCED.setdefault(sub, "outputs cast")
            changed.add(id(sub))
    models = [layer for _, layer, _ in reversed(entries) if isinstance(layer, keras.Model)]
    for sub in models + [model]:
        graph = functional_graph(sub)
        if graph is not None and _refresh_graph(graph, changed):
            changed.add(id(sub))
    return model
