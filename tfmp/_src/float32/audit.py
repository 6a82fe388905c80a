"""`tfmp.audit(model)`: a per-layer dtype report with warnings.

One `AuditRow` per layer: compute, output and variable dtypes, why it computes in
float32, its parameters and warning kinds (listed at `AuditReport.warnings`); the output
dtype comes from the symbolic graph, a ``batch=`` forward pass or the output-dtype rule.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import keras

from tfmp._src.attachment import record as _record
from tfmp._src.constants import LOW_PRECISION
from tfmp._src.errors import check_bool, check_model, check_positive_int, model_fix
from tfmp._src.float32 import audit_cost as _cost
from tfmp._src.float32 import conv as _conv
from tfmp._src.float32 import force as _float32
from tfmp._src.float32.audit_batch import check_batch, gradient_check
from tfmp._src.float32.audit_report import AuditReport, AuditRow, AuditWarning
from tfmp._src.float32 import fused_batchnorm as _fused_batchnorm
from tfmp._src.float32.cast_back import handed_back_dtype
from tfmp._src.float32.logits import projects, reverse_call
from tfmp._src.float32 import reductions as _reductions
from tfmp._src.float32 import registry as _registry
from tfmp._src.float32 import unsafe_ops as _unsafe_ops
from tfmp._src.keras_hooks import layer_calls
from tfmp._src.keras_hooks.functional_graph import functional_graph, nodes_by_depth
from tfmp._src.layer_tree import is_wiring, own_weights, walk
from tfmp._src.policy import session
from tfmp._src.policy.hardware import detect_device_facts

#: How a user gets tfmp's float32 forcing on a model it has not forced.
_FORCE_FIX = "Compiling the model while tfmp is enabled, or tfmp.force_float32(model),"


def _dims(layer: keras.layers.Layer) -> List[Tuple[str, Optional[int]]]:
    """Tensor Core relevant sizes of a Dense or Conv layer (others: none)."""
    kernel = getattr(layer, "kernel", None) if layer.built else None
    shape = tuple(kernel.shape) if kernel is not None else ()
    if isinstance(layer, keras.layers.Dense):
        return [("units", layer.units), ("input size", shape[0] if shape else None)]
    if hasattr(layer, "filters") and hasattr(layer, "kernel_size"):
        return [("filters", layer.filters), ("input channels", shape[-2] if shape else None)]
    return []


def _expected_policy(model: keras.Model) -> Tuple[str, str]:
    """``(policy name, source)`` the model's layers should have (`AuditReport.policy_source`)."""
    attached = _record.of(model)
    current = session.current()
    if attached is not None:
        return attached.policy, "attachment"
    if current is not None:
        return current.decision.policy, "enable"
    return model.dtype_policy.name, "model"


def _layer_warnings(path, layer, reason, producers, policy, tensor_cores, built_under_policy=False):
    """Yields ``(kind, message)`` pairs for one layer; `built_under_policy`: a float32 layer is its author's choice."""
    compute = layer.compute_dtype
    excluded = _float32.excluded_by_user(layer) or _registry.is_excluded(layer, path, ())
    if compute in LOW_PRECISION and not excluded and _registry.builtin_reason(layer):
        reduction = _reductions.wide_reduction(layer) or _unsafe_ops.unsafe_ops(layer)
        yield "sensitive_16bit", (
            f"'{path}' ({type(layer).__name__}) computes in {compute}; "
            + (reduction.advice(path) if reduction else _FORCE_FIX + " computes it in float32.")
        )
    if compute in LOW_PRECISION and id(layer) in producers and reason not in _registry.KEPT_16BIT:
        yield "output_16bit", (
            f"'{path}' produces a model output in {compute}; outputs (and the loss) should be float32. "
            + (f"An exclusion keeps it out of float32: remove the target matching '{path}' from "
               "exclude_float32= (tfmp.enable), exclude= (tfmp.force_float32) or "
               "tfmp.register_float32(..., exclude=True) (tfmp.unregister_float32)."
               if excluded else _FORCE_FIX + " makes its output float32.")
        )
    low_vars = sorted({w.dtype for w in own_weights(layer) if w.dtype in LOW_PRECISION})
    if low_vars:
        yield "variables_16bit", (
            f"'{path}' stores its weights in {low_vars[0]}: no float32 master weights, "
            f"so small updates are lost. Build it under a mixed policy: tfmp.enable('mixed_{low_vars[0]}') "
            f"before building the model, or dtype='mixed_{low_vars[0]}' on the layer."
        )
    pinned = built_under_policy and layer.dtype_policy.name == "float32"
    if not reason and not pinned and keras.backend.is_float_dtype(compute) and layer.dtype_policy.name != policy:
        yield "policy_mismatch", (
            f"'{path}' uses policy '{layer.dtype_policy.name}' but '{policy}' is expected "
            "(tfmp's policy for this model, else the model's): if the model was built "
            f"before tfmp.enable(), rebuild it after; if the layer was given "
            f"dtype='{layer.dtype_policy.name}', pass dtype='{policy}' or leave dtype out."
        )
    if tensor_cores and compute in LOW_PRECISION:
        for name, size in _dims(layer):
            if size is not None and size % 8:
                yield "tensor_core_dims", (
                    f"'{path}' has {name} {size}, not a multiple of 8; Tensor Cores "
                    f"need multiples of 8 in 16 bits (NVIDIA mixed-precision guide): use e.g. "
                    f"{_next_multiple_of_8(size)}."
                )


def _next_multiple_of_8(size: int) -> int:
    return -(-size // 8) * 8


def _dtype(x: Any) -> Optional[str]:
    dtype = getattr(x, "dtype", None)
    return None if dtype is None else keras.backend.standardize_dtype(dtype)


def _graph_facts(model: keras.Model, entries) -> Tuple[Dict[int, List[str]], Dict[int, list], set]:
    """Layer id -> output dtypes, layer id -> ``(consumer, dtype)`` pairs, and ids of projecting embeddings."""
    graphs = [functional_graph(model)] + [
        functional_graph(layer) for _, layer, _ in entries if isinstance(layer, keras.Model)
    ]
    outputs: Dict[int, List[str]] = {}
    consumers: Dict[int, list] = {}
    projecting = set()
    for graph in (g for g in graphs if g is not None):
        nodes = [node for level in nodes_by_depth(graph).values() for node in level]
        users: Dict[int, list] = {}
        for node in nodes:
            for tensor in node.input_tensors:
                users.setdefault(id(tensor), []).append(node.operation)
        for node in nodes:
            if node.is_input or node.operation is None:
                continue
            key = id(node.operation)
            if projects(node.operation) and reverse_call(tuple(node.arguments.args), dict(node.arguments.kwargs)):
                projecting.add(key)
            for tensor in node.outputs:
                outputs.setdefault(key, []).append(_dtype(tensor))
                consumers.setdefault(key, []).extend((u, _dtype(tensor)) for u in users.get(id(tensor), []))
    return outputs, consumers, projecting


def _record_outputs(layers: Sequence[keras.layers.Layer]) -> Tuple[Dict[int, List[str]], list]:
    """Hooks each layer's ``call`` to record its output dtypes; returns (records, hooks)."""
    seen: Dict[int, List[str]] = {}

    def wrap(original, key: int):
        @functools.wraps(original)
        def call(*args, **kwargs):
            outputs = original(*args, **kwargs)
            seen.setdefault(key, []).extend(d for d in map(_dtype, keras.tree.flatten(outputs)) if d is not None)
            return outputs

        return call

    hooks = [layer_calls.subscribe(layer, "call", functools.partial(wrap, key=id(layer)), owner="audit.outputs")
             for layer in layers]
    return seen, hooks


def _rule_dtype(layer: keras.layers.Layer, forced: str) -> str:
    """tfmp's output-dtype rule: float32 for an output producer, else what the layer hands back."""
    if forced == "output" or forced in _registry.CAST_ONLY:
        return "float32"
    return handed_back_dtype(layer) or layer.compute_dtype


def _consumer_warnings(path, layer, why, out_dtypes, consumers, parent, paths):
    """Yields ``(kind, message)`` where a forced layer's output dtype differs from its consumer's."""
    if not why:
        return
    if consumers is None:  # inside custom code: the parent's code consumes it
        consumers = [(parent, d) for d in out_dtypes] if parent is not None and not is_wiring(parent) else []
    reported = set()
    for consumer, dtype in consumers:
        compute = getattr(consumer, "compute_dtype", None)
        if not isinstance(consumer, keras.layers.Layer) or not keras.backend.is_float_dtype(compute or ""):
            continue  # a raw op computes in the promoted dtype of its inputs
        if dtype is None or not keras.backend.is_float_dtype(dtype) or dtype == compute:
            continue
        where = paths.get(id(consumer), consumer.name)
        if (where, dtype) in reported:
            continue
        reported.add((where, dtype))
        yield "consumer_dtype", (
            f"'{path}' (float32: {why}) hands {dtype} to '{where}', which computes in "
            f"{compute}: the value is cast at that boundary. Nothing to change unless '{where}' "
            f"needs it in float32: then keep_float32=['{where}'] in tfmp.enable() "
            f"(keep=['{where}'] in tfmp.force_float32)."
        )


def audit(
    model: keras.Model,
    *,
    batch: Any = None,
    batch_size: Optional[int] = None,
    tensor_cores: Optional[bool] = None,
) -> AuditReport:
    """Reports every layer's dtypes and what may go wrong in mixed precision.

    Args:
        model: ``keras.Model``, built or not (unbuilt layers show 0 params).
        batch: Optional input batch ``x`` or tuple ``(x, y, ...)``. When given,
            one training-mode forward/backward pass lists each trainable
            variable's and its gradient's dtype, checks runtime output dtypes and
            turns mixed-dtype failures into a ``dtype_mismatch`` warning; every
            variable of the model is put back afterwards.
        batch_size: Optional int checked against Tensor Core alignment; defaults
            to the batch's leading size.
        tensor_cores: Optional bool. Whether to apply the multiple-of-8 checks;
            None detects a GPU with compute capability >= 7.0.

    Returns:
        :class:`AuditReport`.

    Raises:
        ValueError: ``model`` is not a ``keras.Model`` or has no layer; ``batch``
            is not an array, tensor or structure of them with at least one
            example, or does not match a graph model's input shapes;
            ``batch_size`` is neither None nor an int >= 1; ``tensor_cores`` is
            neither None nor a bool.
        Exception: any error of the ``batch`` pass propagates unchanged, unless
            the failing op said two dtypes do not match: that one becomes a
            ``dtype_mismatch`` warning.

    Example:
        >>> import keras, tfmp
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="logits")])
        >>> [(row.path, row.compute_dtype) for row in tfmp.audit(model).rows]
        [('logits', 'float32')]
    """
    check_model("model", model, fix=model_fix("tfmp.audit(model)"))
    if batch is not None:
        check_batch(model, batch)
    check_positive_int("batch_size", batch_size, allow_none=True,
                       fix="Pass the batch size training uses, e.g. batch_size=32, or None.")
    check_bool("tensor_cores", tensor_cores, allow_none=True)
    policy, policy_source = _expected_policy(model)
    if tensor_cores is None:  # Tensor Cores arrived with compute capability 7.0 (NVIDIA, Volta)
        capability = detect_device_facts().min_compute_capability
        tensor_cores = capability is not None and capability >= (7, 0)
    producers = {id(layer) for layer in _float32.output_producers(model)[0]}
    entries = walk(model)
    paths = {id(layer): path for path, layer, _ in entries}
    paths_to_layers = {path: layer for path, layer, _ in entries}
    parents = {id(layer): parent for _, layer, parent in entries}
    graph_outputs, graph_consumers, projecting = _graph_facts(model, entries)
    found: List[AuditWarning] = []
    late: List[AuditWarning] = []  # run-time findings, listed after the per-layer ones
    gradients, run_outputs = (), {}
    if batch is not None:
        unseen = [layer for _, layer, _ in entries if id(layer) not in graph_outputs]
        run_outputs, hooks = _record_outputs(unseen)
        try:
            gradients, out_dtypes, errors = gradient_check(model, batch, entries)
        finally:
            for hook in hooks:
                hook.remove()
        late += errors
        for i, dtype in enumerate(out_dtypes):
            if dtype in LOW_PRECISION:
                late.append(AuditWarning("output_16bit", f"<output {i}>", (
                    f"model output {i} is {dtype} at run time; {_FORCE_FIX} casts a subclassed "
                    "model's outputs to float32 (or cast it in call(): keras.ops.cast(x, 'float32'))."
                )))
        if batch_size is None:
            batch_size = int(keras.tree.flatten(batch)[0].shape[0])
    rows, total, forced = [], 0, []  # forced: layers multiplying in float32 (`audit_cost.float32_heavy`)
    compute_mixed = policy.startswith("mixed")
    for path, layer, parent in entries:
        reason = _float32.forced_reason(layer) or ""
        why = reason or _registry.keras_float32_reason(layer) or _conv.audit_reason(layer) or ""
        if id(layer) in graph_outputs:
            out_dtypes, output_from = graph_outputs[id(layer)], "graph"
        elif batch is not None:
            out_dtypes, output_from = run_outputs.get(id(layer), []), "run"
        else:
            out_dtypes, output_from = [_rule_dtype(layer, reason)], "rule"
        weights = own_weights(layer)
        params = sum(int(w.numpy().size) for w in weights)
        # A tied embedding outside any graph is taken to project: that is what it is for.
        projects_here = id(layer) in projecting if id(layer) in graph_outputs else projects(layer)
        multiplied = _cost.multiplied_params(layer, weights, projects_here)
        multiplied += _cost.borrowed_tables(layer, parents)
        total += multiplied
        if projects_here and layer.variable_dtype == "float32" and compute_mixed:
            if _cost.float32_projection(layer):
                forced.append((path, layer, reason if reason and reason not in _registry.CAST_ONLY
                               else _cost.KERAS_PROJECTION, multiplied))
        elif reason and reason not in _registry.KEPT_16BIT:
            forced.append((path, layer, reason, multiplied))
        kinds = []
        consumers = graph_consumers.get(id(layer)) if output_from == "graph" else None
        for kind, message in [
            *_layer_warnings(path, layer, reason, producers, policy, tensor_cores,
                             built_under_policy=model.dtype_policy.name == policy),
            *_consumer_warnings(path, layer, reason, out_dtypes, consumers, parent, paths),
        ]:
            kinds.append(kind)
            found.append(AuditWarning(kind, path, message))
        dtype = weights[0].dtype if weights else layer.variable_dtype
        output_dtype = ",".join(dict.fromkeys(out_dtypes)) or "-"
        rows.append(AuditRow(path, type(layer).__name__, layer.compute_dtype, output_dtype, dtype,
                             reason, why, params, tuple(dict.fromkeys(kinds)), output_from,
                             _fused_batchnorm.audit_note(layer)))
    found += late
    global_compute = keras.config.dtype_policy().compute_dtype
    if tensor_cores and batch_size and batch_size % 8 and global_compute in LOW_PRECISION:
        found.append(AuditWarning("tensor_core_dims", "<batch>", (
            f"batch size {batch_size} is not a multiple of 8; Tensor Cores need multiples of 8 "
            f"in 16 bits: use e.g. {_next_multiple_of_8(batch_size)}.")))
    fraction = sum(params for *_, params in forced) / total if total else 0.0
    heavy = _cost.float32_heavy(forced, paths_to_layers, total, fraction, policy)
    if heavy:
        found.append(AuditWarning("float32_heavy", "<model>", heavy))
    return AuditReport(policy, tuple(rows), tuple(found), fraction, gradients, policy_source)
