"""`tfmp.export`: a SavedModel or TFLite file from the float32 copy, checked.

The path and the sample are checked before anything is written. A sample batch then runs
through the written artifact's ``serving_default`` signature, as a deployment runs it, and
through the trained model; the report gives the largest difference.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmp._src.deployment.report import FORMATS, WEIGHTS, ExportReport
from tfmp._src.deployment.to_float32 import to_float32
from tfmp._src.errors import invalid_argument
from tfmp._src.keras_hooks import error_texts
from tfmp._src.keras_hooks.export_io import export_input_specs, tflite_converter_error
from tfmp._src.keras_hooks.functional_graph import functional_graph
from tfmp._src.layer_tree import walk

SIGNATURE = "serving_default"
SAMPLE_BATCH = 4
SAMPLE_SEED = 0


def export(
    model: keras.Model,
    path: str,
    format: str = "tf_saved_model",  # noqa: A002 (the public name is fixed)
    weights: str = "float32",
    sample: Optional[Any] = None,
) -> ExportReport:
    """Writes a deployable artifact of `model` and checks it against the model.

    The artifact is made from ``tfmp.to_float32(model)``: TFLite's builtin kernels have
    no bfloat16 or float16 ops, so a mixed model fails to convert ("neither a custom op
    nor a flex op") unless TF Select ships TensorFlow kernels for its 16-bit ops.

    A sample batch then runs through the written artifact (its ``serving_default``
    signature) and the trained model (``training=False``); the largest differences are
    the price of 16-bit compute plus, with ``weights="float16"``, the quantization.

    Args:
        model: A built `keras.Model`, as `tfmp.to_float32` accepts. Not changed.
        path: String or path-like. For ``"tf_saved_model"`` a folder: new, empty or
            an earlier SavedModel (replaced); for ``"tflite"`` a file (replaced if it
            exists). Parent folders are created.
        format: String. ``"tf_saved_model"`` (Keras's ``model.export``) or
            ``"tflite"`` (``tf.lite.TFLiteConverter`` from that SavedModel).
        weights: String. ``"float32"``, or ``"float16"`` (TFLite only): weights
            stored in float16, about half the file, dequantized when loaded.
        sample: The inputs to check with, as the model takes them (an array, or a
            list/dict of arrays), at least one row of each input's shape, finite,
            integers for an integer input; or None: 4 rows of standard normal floats
            (seed 0), zeros for integer inputs.

    Returns:
        `ExportReport` with the path, format, weights, file size, output shapes and
        dtypes, and ``max_abs_diff`` / ``max_rel_diff`` (the latter relative to the
        largest magnitude of the trained model's output).

    Raises:
        ValueError: (template; before anything is written) `format` or `weights` is
            not one of the accepted values; ``weights="float16"`` with
            ``format="tf_saved_model"``; `path` is empty, not a string or path-like,
            under an existing file, or (for a SavedModel) an existing file or a
            non-empty folder without an earlier SavedModel, or (for TFLite) a folder;
            `model` is not a built, called `keras.Model` or cannot be copied (see
            `tfmp.to_float32`); `sample` does not fit the inputs (count, shape, dtype,
            finite values). Also, after writing, when TFLite cannot convert an op of
            the float32 copy (naming the op, the layer when known, and the converter's
            words, its error chained).
    """
    _check_choice("format", format, FORMATS,
                  fix="Pass format='tf_saved_model' (a folder, the default) or format='tflite' (a file).")
    _check_choice("weights", weights, WEIGHTS,
                  fix="Pass weights='float32' (the default), or weights='float16' with format='tflite'.")
    if weights == "float16" and format != "tflite":
        raise invalid_argument(
            "weights", weights, "'float32' with format='tf_saved_model'",
            fix="Float16 weight quantization is a TFLite option: pass format='tflite', "
            "or weights='float32'.",
        )
    path = checked_path(path, format)
    copy = to_float32(model)  # refuses anything but a built keras.Model
    specs = input_specs(copy)
    if len(specs) > 1 and functional_graph(copy) is None:
        raise _signature_mismatch(copy, [spec.name for spec in specs])
    flat = checked_sample(sample, specs)
    with tempfile.TemporaryDirectory(prefix="tfmp_export_") as scratch:
        # Written beside first: an earlier export at `path` stays whole until the new one is.
        saved_model = os.path.join(scratch, "saved_model")
        copy.export(saved_model, format="tf_saved_model", verbose=False)
        names = _input_names(copy, saved_model_inputs(saved_model))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if format == "tflite":
            with open(path, "wb") as file:
                file.write(_convert(copy, saved_model, weights))
            run = run_tflite
        else:
            if os.path.isdir(path):
                shutil.rmtree(path)  # empty, or an earlier SavedModel (checked_path)
            shutil.move(saved_model, path)
            run = run_saved_model
        produced = run(path, dict(zip(names, flat)))
    expected = _trained_outputs(model, flat)
    return _report(path, format, weights, expected, produced)


def _check_choice(name: str, value: Any, choices: Sequence[str], fix: str) -> None:
    if not isinstance(value, str) or value not in choices:
        expected = "one of " + ", ".join(repr(c) for c in choices)
        raise invalid_argument(name, value, expected, fix=fix, choices=choices)


def _convert(copy: keras.Model, saved_model: str, weights: str) -> bytes:
    """TFLite flatbuffer of the SavedModel; a clear error naming op and layer."""
    converter = tf.lite.TFLiteConverter.from_saved_model(saved_model)
    if weights == "float16":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_types = [tf.float16]
    try:
        return converter.convert()
    except tflite_converter_error() as error:
        message = str(error)
        ops = sorted(set(re.findall(r"'tf\.(\w+)' op", message)))
        layer = _layer_in_message(copy, message)
        where = f" at layer {layer!r}" if layer else ""
        what = f" (TensorFlow ops {', '.join(ops)})" if ops else ""
        first = next((line.strip() for line in message.splitlines() if "error" in line), "")
        low = error_texts.converter_16bit_dtypes(message)
        if low:  # the layer's own code casts to a fixed 16-bit dtype: to_float32 cannot change that
            cause = (f"; the op computes in {' and '.join(low)} although the copy's policies are float32: the "
                     "layer's own code casts to a fixed 16-bit dtype (e.g. keras.ops.cast(x, "
                     f"{low[0]!r})), and TFLite's builtin kernels have no {' or '.join(low)} ops. Fix: cast to "
                     "the layer's self.compute_dtype instead (the float32 copy then computes in float32)")
        else:
            cause = (". The copy computes in float32, so this is an op TFLite's builtin kernels lack, not a "
                     "mixed-precision one. Fix: replace the op in that layer")
        raise ValueError(
            f"TFLite cannot convert the float32 copy of model {copy.name!r}{where}{what}{cause}; "
            "or, if the deployment can ship TensorFlow kernels, convert "
            "the SavedModel yourself with converter.target_spec.supported_ops "
            "including tf.lite.OpsSet.SELECT_TF_OPS. Converter said: "
            f"{first[:500]}"
        ) from error


def _layer_in_message(copy: keras.Model, message: str) -> Optional[str]:
    """The path of the layer named first in a converter location ``"<model>/<layer>/<op>@<fn>"``, or None.

    Name scopes may suffix a name (``"inverse_1"``): an exact name wins at the same place.
    """
    found = []
    for entry in walk(copy):
        name = re.escape(entry.layer.name)
        match = re.search(rf"/({name})(_\d+)?/", message)
        if match:
            found.append((match.start(), bool(match.group(2)), -len(entry.path), entry.path))
    return min(found)[-1] if found else None


def _input_names(copy: keras.Model, specs: Dict[str, tf.TensorSpec]) -> List[str]:
    """Signature input names in the order of the model's flattened inputs."""
    if len(specs) == 1:
        return list(specs)
    if functional_graph(copy) is not None:
        names = [tensor.name for tensor in tf.nest.flatten(copy.input)]
        if sorted(names) == sorted(specs):
            return names
    raise _signature_mismatch(copy, sorted(specs))


def _signature_mismatch(copy: keras.Model, names: List[str]) -> ValueError:
    return invalid_argument(
        "model", copy, "a model whose serving signature's inputs match its inputs",
        fix=f"The signature takes {names}; export a Functional model with "
        "these inputs, or a model with a single input.",
    )


def _trained_outputs(model: keras.Model, flat: List[np.ndarray]) -> List[np.ndarray]:
    inputs = flat[0] if len(flat) == 1 else tf.nest.pack_sequence_as(model.input, flat)
    outputs = model(inputs, training=False)
    return [
        np.asarray(tf.convert_to_tensor(x).numpy()).astype(np.float32)
        for x in tf.nest.flatten(outputs)
    ]


def _report(
    path: str, format: str, weights: str,  # noqa: A002
    expected: List[np.ndarray], produced: Dict[str, np.ndarray],
) -> ExportReport:
    actual = [produced[key] for key in output_order(produced)]
    if [a.shape for a in actual] != [e.shape for e in expected]:
        raise ValueError(
            f"The artifact at {path!r} returns outputs of shapes "
            f"{[a.shape for a in actual]}, the trained model "
            f"{[e.shape for e in expected]}; the export does not match the model."
        )
    abs_diffs, rel_diffs = [], []
    for got, want in zip(actual, expected):
        diff = float(np.max(np.abs(got.astype(np.float64) - want))) if want.size else 0.0
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        abs_diffs.append(diff)
        rel_diffs.append(diff / scale if scale > 0 else diff)
    return ExportReport(
        path=path,
        format=format,
        weights=weights,
        max_abs_diff=max(abs_diffs),
        max_rel_diff=max(rel_diffs),
        output_shapes=tuple(tuple(a.shape) for a in actual),
        output_dtypes=tuple(str(a.dtype) for a in actual),
        size_bytes=size_bytes(path),
        sample_rows=int(expected[0].shape[0]) if expected and expected[0].ndim else 0,
    )


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


def saved_model_inputs(path: str) -> Dict[str, tf.TensorSpec]:
    """The serving signature's inputs of the SavedModel in folder `path`, by name."""
    signature = tf.saved_model.load(path).signatures[SIGNATURE]
    return dict(signature.structured_input_signature[1])


def run_saved_model(path: str, inputs: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Runs `inputs` (arrays by input name) through the SavedModel's serving signature."""
    signature = tf.saved_model.load(path).signatures[SIGNATURE]
    outputs = signature(**{name: tf.constant(value) for name, value in inputs.items()})
    return {name: value.numpy() for name, value in outputs.items()}


def tflite_interpreter(path: str) -> Any:
    """An interpreter for the TFLite file `path`: LiteRT's when installed, else TF's (its move notice silenced)."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"(?s).*tf\.lite\.Interpreter is deprecated", category=UserWarning
            )
            return tf.lite.Interpreter(model_path=path)
    return Interpreter(model_path=path)


def run_tflite(path: str, inputs: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Runs `inputs` through the TFLite file's serving signature (batch resized)."""
    runner = tflite_interpreter(path).get_signature_runner(SIGNATURE)
    outputs = runner(**inputs)
    return {name: np.array(value) for name, value in outputs.items()}


def output_order(outputs: Dict[str, Any]) -> List[str]:
    """Output names in the model's order: Keras's ``output_<i>`` by i, a dict's keys sorted (as `tf.nest`)."""
    indexed = [re.fullmatch(r"output_(\d+)", name) for name in outputs]
    if all(indexed):
        return sorted(outputs, key=lambda name: int(name.rsplit("_", 1)[1]))
    return sorted(outputs)


def size_bytes(path: str) -> int:
    """Bytes on disk of the file, or of every file under the folder, at `path`."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(path)
        for name in names
    )
