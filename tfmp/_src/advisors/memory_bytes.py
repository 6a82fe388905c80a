"""Bytes of tensors and variables, for `tfmp.estimate_memory` and `tfmp.estimate_kv_cache`."""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Optional

import keras
import tensorflow as tf


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
    seen, out = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def variables_bytes(variables: Iterable[Any], float_dtype: Optional[str] = None) -> int:
    """Bytes held by `variables` (each counted once), float ones at `float_dtype` when given."""
    total = 0
    for v in unique(variables):
        dtype = keras.backend.standardize_dtype(v.dtype)
        if float_dtype and keras.backend.is_float_dtype(dtype):
            dtype = float_dtype
        total += tensor_bytes(v.shape, dtype)
    return total
