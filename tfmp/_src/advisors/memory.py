"""`tfmp.estimate_memory` and `tfmp.estimate_kv_cache`: what training or decoding takes, per policy.

Parameters, gradients and optimizer variables are counted from the built objects (exact),
activations estimated: whether a mixed policy saves memory is known before a run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, List, Optional, Tuple, Union

import keras
import tensorflow as tf

from tfmp._src.constants import TROUBLESHOOTING_GUIDE
from tfmp._src.errors import check_positive_int, invalid_argument
from tfmp._src.report_fields import COUNT, POSITIVE_INT, STRING, check_fields, tuple_of


def format_bytes(n: int) -> str:
    """Human-readable size in binary units: ``1536`` -> ``"1.50 KiB"``."""
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{int(size)} B" if unit == "B" else f"{size:.2f} {unit}"


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of `dtype` (``"bfloat16"`` -> 2, ``"int64"`` -> 8)."""
    return tf.as_dtype(keras.backend.standardize_dtype(dtype)).size


def tensor_bytes(shape: Iterable[int], dtype: Any) -> int:
    return int(math.prod(int(d) for d in shape)) * dtype_bytes(dtype)


def unique(variables: Iterable[Any]) -> List[Any]:
    """`variables` without repeats (by identity: variables need not be hashable), in order."""
    return list({id(v): v for v in variables}.values())


def variables_bytes(variables: Iterable[Any], float_dtype: Optional[str] = None) -> int:
    """Bytes held by `variables` (each counted once), float ones at `float_dtype` when given."""
    total = 0
    for v in unique(variables):
        dtype = keras.backend.standardize_dtype(v.dtype)
        if float_dtype and keras.backend.is_float_dtype(dtype):
            dtype = float_dtype
        total += tensor_bytes(v.shape, dtype)
    return total


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a model needs for training, under a policy and under float32.

    Attributes:
        policy: String. Policy the activations were counted for, e.g.
            ``"mixed_bfloat16"``, or ``"as built (...)"`` for the layers' own dtypes.
        batch_size: Int. Samples per batch the activations were counted for.
        parameter_bytes: Int. All model variables at their dtypes (exact).
        gradient_bytes: Int. One gradient per trainable variable (exact).
        optimizer_bytes: Int. All optimizer variables (exact); 0 without optimizer.
        optimizer_scalar_bytes: Int. The scalar part of `optimizer_bytes` (iteration
            counters, learning rate, loss scale).
        activation_bytes: Int. Layer outputs for one batch (estimate).
        float32_parameter_bytes: Int. `parameter_bytes` with float variables at 4 bytes.
        float32_gradient_bytes: Int. `gradient_bytes` with float variables at 4 bytes.
        float32_activation_bytes: Int. `activation_bytes` with float outputs at 4 bytes.
        notes: Tuple of strings. Layers skipped and other caveats.

    Raises:
        ValueError: (template) `policy` not a string, `batch_size` not an
            integer >= 1, a byte count not an integer >= 0, `notes` not a tuple of strings.
    """

    policy: str
    batch_size: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    optimizer_scalar_bytes: int
    activation_bytes: int
    float32_parameter_bytes: int
    float32_gradient_bytes: int
    float32_activation_bytes: int
    notes: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        counts = {field.name: COUNT for field in dataclasses.fields(self) if field.name.endswith("_bytes")}
        check_fields(self, policy=STRING, batch_size=POSITIVE_INT, notes=tuple_of(STRING), **counts)

    @property
    def total_bytes(self) -> int:
        """Int. Parameters + gradients + optimizer + activations under `policy`."""
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes
                + self.activation_bytes)

    @property
    def float32_total_bytes(self) -> int:
        """Int. The same total with every float tensor in float32."""
        return (self.float32_parameter_bytes + self.float32_gradient_bytes
                + self.optimizer_bytes + self.float32_activation_bytes)

    @property
    def saving_bytes(self) -> int:
        """Int. `float32_total_bytes - total_bytes` (negative means more memory)."""
        return self.float32_total_bytes - self.total_bytes

    def to_dict(self) -> dict:
        """Returns the fields and totals as a JSON-serializable dict (bytes as ints)."""
        out = dataclasses.asdict(self)
        out["notes"] = list(self.notes)
        out.update(total_bytes=self.total_bytes,
                   float32_total_bytes=self.float32_total_bytes,
                   saving_bytes=self.saving_bytes)
        return out

    def __str__(self) -> str:
        rows = [
            ("parameters", self.parameter_bytes, self.float32_parameter_bytes),
            ("gradients", self.gradient_bytes, self.float32_gradient_bytes),
            ("optimizer", self.optimizer_bytes, self.optimizer_bytes),
            ("activations", self.activation_bytes, self.float32_activation_bytes),
            ("total", self.total_bytes, self.float32_total_bytes),
        ]
        width = max(len(self.policy), 10)
        lines = [f"Memory estimate for batch_size={self.batch_size}",
                 f"{'':<12} {self.policy:>{width}} {'float32':>12}"]
        lines += [f"{n:<12} {format_bytes(a):>{width}} {format_bytes(b):>12}"
                  for n, a, b in rows]
        share = self.saving_bytes / max(self.float32_total_bytes, 1)
        lines.append(f"saving: {format_bytes(self.saving_bytes)} ({share:.1%} of float32); "
                     f"activations are an estimate, see {TROUBLESHOOTING_GUIDE}#no-memory-saving")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _leaf_layers(model: keras.Model) -> List[keras.layers.Layer]:
    """Layers of `model`, descending into nested models only (only their outputs are symbolic)."""
    leaves = []
    for layer in model.layers:
        leaves.extend(_leaf_layers(layer) if isinstance(layer, keras.Model) else [layer])
    return leaves


def _activation_bytes(
    model: keras.Model, batch_size: int, compute_dtype: Optional[str]
) -> Tuple[int, int, List[str]]:
    """(bytes at compute_dtype or the layers' own dtypes, float32 bytes, notes)."""
    counted, baseline, notes = 0, 0, []
    for layer in _leaf_layers(model):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        try:
            outputs = keras.tree.flatten(layer.output)
        except (AttributeError, ValueError):
            notes.append(f"layer {layer.name!r} has no symbolic output; not counted")
            continue
        for out in outputs:
            dims = list(out.shape)
            if any(d is None for d in dims[1:]):
                notes.append(f"layer {layer.name!r} output {tuple(dims)} has an "
                             "unknown non-batch dimension; not counted")
                continue
            shape = [batch_size] + [int(d) for d in dims[1:]]
            dtype = keras.backend.standardize_dtype(out.dtype)
            is_float = keras.backend.is_float_dtype(dtype)
            counted += tensor_bytes(shape, compute_dtype if (is_float and compute_dtype)
                                     else dtype)
            baseline += tensor_bytes(shape, "float32" if is_float else dtype)
    return counted, baseline, notes


_ACCEPTED = {
    "optimizer": ("None, a keras.optimizers.Optimizer or its name",
                  "Pass e.g. optimizer='adam' or keras.optimizers.Adam()."),
    "policy": ("None, a Keras policy name or a keras.DTypePolicy", "Pass e.g. policy='mixed_bfloat16'."),
}


def _refused(name: str, value: Any) -> ValueError:
    expected, fix = _ACCEPTED[name]
    return invalid_argument(name, value, expected, fix=fix)


def _built_optimizer(model: keras.Model, optimizer: Any) -> Optional[Any]:
    """The optimizer to count, built on the model's trainable variables."""
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            return None
    if isinstance(optimizer, (str, dict)):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except (ValueError, TypeError) as error:
            raise _refused("optimizer", optimizer) from error
    elif not isinstance(optimizer, keras.optimizers.Optimizer):
        raise _refused("optimizer", optimizer)
    elif not optimizer.built:
        # Count a fresh copy so the caller's optimizer is not built here.
        optimizer = optimizer.__class__.from_config(optimizer.get_config())
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return optimizer


def estimate_memory(
    model: keras.Model,
    batch_size: int,
    policy: Optional[Union[str, keras.DTypePolicy]] = None,
    optimizer: Optional[Union[str, keras.optimizers.Optimizer]] = None,
) -> MemoryEstimate:
    """Estimates training memory of `model` under `policy` and under float32.

    Parameters (each variable at its own dtype), gradients and optimizer variables are
    exact. Activations are an order of magnitude, not a peak: one output per leaf layer
    for `batch_size` examples (what backpropagation keeps); temporary buffers, activation
    gradients, the input batch, allocator overhead and 16-bit weight copies are not
    counted. See tfmp/docs/troubleshooting.md#no-memory-saving.

    Args:
        model: Built `keras.Model` (Functional or Sequential for activations, so
            its layers have symbolic outputs).
        batch_size: Int > 0. Samples per batch for the activation count.
        policy: None, a policy name (``"mixed_bfloat16"``, ``"mixed_float16"``,
            ``"float32"``...) or a `keras.DTypePolicy`. None counts every layer's
            output at the dtype it really has (float32 forcing included); a policy
            counts every floating-point output at that policy's compute dtype.
        optimizer: None (the model's compiled optimizer, if any), an optimizer name
            such as ``"adam"``, or a `keras.optimizers.Optimizer` (one not built is
            counted through a built copy and left unbuilt).

    Returns:
        `MemoryEstimate` (bytes, ints).

    Raises:
        ValueError: (template) `model` is not a built Keras model, `batch_size` is
            not a positive int, `policy` is not None, a Keras policy name or a
            `keras.DTypePolicy`, or `optimizer` is not None, an optimizer or the
            name (or config dict) of one.

    Example:
        >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        >>> est = estimate_memory(model, batch_size=32, policy="mixed_bfloat16",
        ...                       optimizer="adam")
        >>> est.parameter_bytes, est.activation_bytes, est.float32_activation_bytes
        (2600, 640, 1280)
    """
    if not isinstance(model, keras.Model) or not model.built:
        raise invalid_argument(
            "model", model, "a built keras.Model",
            fix="Build it first, e.g. start it with keras.Input(shape) or call "
                "model.build(input_shape).")
    check_positive_int("batch_size", batch_size, fix="Pass e.g. batch_size=32.")
    if policy is None:
        compute_dtype, label = None, f"as built ({model.dtype_policy.name})"
    else:
        if not isinstance(policy, (str, keras.DTypePolicy)):
            raise _refused("policy", policy)
        try:
            dtype_policy = keras.dtype_policies.get(policy)
        except (ValueError, TypeError) as error:
            raise _refused("policy", policy) from error
        compute_dtype, label = dtype_policy.compute_dtype, dtype_policy.name
    opt = _built_optimizer(model, optimizer)
    opt_vars = unique(opt.variables) if opt is not None else []
    activations, float32_activations, notes = _activation_bytes(
        model, batch_size, compute_dtype)
    if opt is None:
        notes.append("no optimizer given and the model is not compiled; "
                     "optimizer bytes are 0")
    return MemoryEstimate(
        policy=label,
        batch_size=batch_size,
        parameter_bytes=variables_bytes(model.variables),
        gradient_bytes=variables_bytes(model.trainable_variables),
        optimizer_bytes=variables_bytes(opt_vars),
        optimizer_scalar_bytes=variables_bytes(v for v in opt_vars if len(v.shape) == 0),
        activation_bytes=activations,
        float32_parameter_bytes=variables_bytes(model.variables, "float32"),
        float32_gradient_bytes=variables_bytes(model.trainable_variables, "float32"),
        float32_activation_bytes=float32_activations,
        notes=tuple(notes),
    )


def estimate_kv_cache(
    num_layers: int,
    hidden_size: int,
    seq_len: int,
    batch_size: int,
    dtype: str = "float16",
) -> int:
    """Bytes of a Transformer decoder's key/value cache at inference.

    Every layer keeps one key and one value vector of `hidden_size` elements per
    token: ``2 * num_layers * hidden_size * bytes_per_element`` bytes per token,
    times `seq_len` tokens and `batch_size` sequences. For grouped-query or
    multi-query attention pass ``hidden_size = num_kv_heads * head_dim``.

    Args:
        num_layers: Int > 0. Attention layers.
        hidden_size: Int > 0. Elements of one key (or value) vector per token.
        seq_len: Int > 0. Tokens cached per sequence (prompt plus generated).
        batch_size: Int > 0. Sequences decoded together.
        dtype: String. Cache dtype (``"float16"``, ``"bfloat16"``, ``"float32"``,
            ``"int8"``...) or a mixed policy name, meaning its compute dtype.

    Returns:
        Int, bytes.

    Raises:
        ValueError: (template) a size is not a positive int, or `dtype` is not
            the name of a floating-point or integer dtype (or of a mixed policy).

    Example:
        >>> estimate_kv_cache(32, 4096, seq_len=1, batch_size=1, dtype="float16")
        524288
    """
    for name, value, example in (("num_layers", num_layers, 32), ("hidden_size", hidden_size, 4096),
                                 ("seq_len", seq_len, 2048), ("batch_size", batch_size, 1)):
        check_positive_int(name, value, fix=f"Pass e.g. {name}={example}.")
    if isinstance(dtype, str) and dtype.startswith("mixed_"):
        dtype = dtype[len("mixed_"):]
    try:
        if not isinstance(dtype, str):
            raise TypeError(dtype)
        per_element = dtype_bytes(dtype)
        if not tf.as_dtype(dtype).is_floating and not tf.as_dtype(dtype).is_integer:
            raise TypeError(dtype)
    except (ValueError, TypeError) as error:
        raise invalid_argument(
            "dtype", dtype, "a dtype name such as 'float16', 'bfloat16' or 'float32'",
            choices=("float16", "bfloat16", "float32", "int8"),
            fix="Pass e.g. dtype='float16' (the default).") from error
    return 2 * num_layers * hidden_size * per_element * seq_len * batch_size
