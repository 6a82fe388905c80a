"""What `tfmp.export` checks before it writes anything: the path and the sample.

A SavedModel written into a folder holding other files mixes what cannot be told apart,
and a sample that does not fit the model's inputs would only fail inside the artifact.
"""

from __future__ import annotations

import os
from typing import Any, List

import numpy as np
import tensorflow as tf

from tfmp._src.errors import invalid_argument
from tfmp._src.keras_hooks.export_io import export_input_specs

SAMPLE_BATCH = 4
SAMPLE_SEED = 0


def checked_path(path: Any, format: str) -> str:  # noqa: A002 (export's argument name)
    """`path` as a string, once it is a place `export` may write `format` to (see `tfmp.export`)."""
    kind = "folder" if format == "tf_saved_model" else "file"
    expected = f"a non-empty string or path-like naming the {kind} to write"
    if not isinstance(path, (str, os.PathLike)):
        raise invalid_argument("path", path, expected, fix="Pass e.g. path='exports/model'.")
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        raise invalid_argument(
            "path", path, expected,
            fix="An empty path would write into the current folder; name a folder, e.g. path='exports/model'.")
    parent = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise invalid_argument("path", path, "a path whose existing parents are folders",
                               fix=f"{parent!r} is a file, not a folder: choose another path.")
    if format == "tf_saved_model" and os.path.exists(text) and not _replaceable_folder(text):
        raise invalid_argument(
            "path", path, "a new folder, an empty one, or one holding an earlier SavedModel "
            "(replaced) for format='tf_saved_model'",
            fix="It holds files that are not a SavedModel; choose another path.")
    if format == "tflite" and os.path.isdir(text):
        raise invalid_argument("path", path, "a file path for format='tflite', not a folder",
                               fix=f"Pass e.g. path={os.path.join(text, 'model.tflite')!r}.")
    return text


def _replaceable_folder(path: str) -> bool:
    """True for a folder `export` may replace: empty, or an earlier SavedModel's."""
    return os.path.isdir(path) and (
        not os.listdir(path) or os.path.isfile(os.path.join(path, "saved_model.pb")))


def input_specs(copy: Any) -> List[Any]:
    """The `keras.InputSpec` of each input of `copy`, flattened; refused for a model never called."""
    try:
        return export_input_specs(copy)
    except ValueError as error:
        raise invalid_argument(
            "model", copy, "a model called at least once (Keras exports the inputs of its first call)",
            fix="Call it on a batch of inputs first, e.g. model(x[:1]).") from error


def checked_sample(sample: Any, specs: List[Any]) -> List[np.ndarray]:
    """The sample as one array per spec in its dtype, once it fits; made when `sample` is None."""
    if sample is None:
        return _made_sample(specs)
    try:
        flat = [np.asarray(x) for x in tf.nest.flatten(sample)]
    except (ValueError, TypeError) as error:
        raise invalid_argument("sample", sample, "arrays of numbers, as the model takes them",
                               fix="Pass e.g. sample=x_test[:8], or None for a generated batch.") from error
    if len(flat) != len(specs):
        raise invalid_argument(
            "sample", sample, f"{len(specs)} input array(s), as the model takes them",
            fix=f"Received {len(flat)} array(s); pass one per model input.")
    return [_checked_array(array, spec, sample) for array, spec in zip(flat, specs)]


def _checked_array(array: np.ndarray, spec: Any, sample: Any) -> np.ndarray:
    shape, dtype = tuple(spec.shape), np.dtype(tf.as_dtype(spec.dtype).as_numpy_dtype)
    name = f"input {spec.name!r}" if spec.name else "the input"
    fits = array.ndim == len(shape) and array.ndim >= 1 and array.shape[0] >= 1 and all(
        want is None or want == got for want, got in zip(shape[1:], array.shape[1:]))
    if not fits:
        raise invalid_argument(
            "sample", sample, f"arrays of the inputs' shapes; {name} takes shape {shape} (None: any size)",
            fix=f"Received an array of shape {array.shape}; pass at least one row of that shape.")
    lossless = array.dtype.kind in "biu" or (array.dtype.kind == "f" and dtype.kind == "f")
    if not lossless:
        raise invalid_argument(
            "sample", sample, f"numbers that convert to {dtype.name} without loss for {name}",
            fix=f"Received an array of dtype {array.dtype}; pass e.g. a {dtype.name} array.")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise invalid_argument("sample", sample, "finite values (NaN or Inf make every difference NaN)",
                               fix="Pass a batch of real inputs, or sample=None.")
    return array.astype(dtype)


def _made_sample(specs: List[Any]) -> List[np.ndarray]:
    """`SAMPLE_BATCH` rows per input: standard normal floats, zeros for integers."""
    rng = np.random.default_rng(SAMPLE_SEED)
    flat = []
    for spec in specs:
        shape = [SAMPLE_BATCH] + list(spec.shape[1:])
        dtype = np.dtype(tf.as_dtype(spec.dtype).as_numpy_dtype)
        if None in shape:
            raise invalid_argument(
                "sample", None, "a batch of inputs when an input has an unknown dimension "
                f"(input {spec.name!r} has shape {tuple(spec.shape)})",
                fix="Pass sample=<array of the model's input shape>.")
        if dtype.kind == "f":
            flat.append(rng.standard_normal(shape).astype(dtype))
        else:
            flat.append(np.zeros(shape, dtype=dtype))
    return flat
