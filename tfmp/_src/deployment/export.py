"""`tfmp.export`: a SavedModel or TFLite file from the float32 copy, checked.

A sample batch runs through the written artifact as a deployment runs it and through
the trained model, and the report gives the largest difference.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmp._src.deployment import artifacts, export_checks
from tfmp._src.deployment.report import FORMATS, WEIGHTS, ExportReport
from tfmp._src.deployment.to_float32 import to_float32
from tfmp._src.errors import invalid_argument
from tfmp._src.keras_hooks.export_io import tflite_converter_error
from tfmp._src.keras_hooks.functional_graph import functional_graph
from tfmp._src.layer_tree import walk


def export(
    model: keras.Model,
    path: str,
    format: str = "tf_saved_model",  # noqa: A002 (the public name is fixed)
    weights: str = "float32",
    sample: Optional[Any] = None,
) -> ExportReport:
    """Writes a deployable artifact of `model` and checks it against the model.

    The artifact is made from ``tfmp.to_float32(model)``, never from the trained
    model: TFLite's builtin kernels have no bfloat16 or float16 ops, so converting a
    mixed model directly fails with a ``ConverterError`` ("neither a custom op nor a
    flex op") suggesting TF Select, which would ship TensorFlow kernels to run 16-bit
    ops a float32 deployment does not want.

    Then a sample batch runs through the written artifact (the SavedModel's
    ``serving_default`` signature, or the TFLite file in an interpreter) and through
    the trained model (``training=False``), and the largest differences are
    reported: the price of the trained model's 16-bit compute plus, with
    ``weights="float16"``, the weight quantization.

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
        ValueError: (template; before anything is written, so a refused call leaves
            the file system as it was) `format` or `weights` is not one of the accepted
            values; ``weights="float16"`` with ``format="tf_saved_model"``; `path` is
            empty, not a string or path-like, under an existing file, or (for a
            SavedModel) an existing file or a non-empty folder without an earlier
            SavedModel, or (for TFLite) a folder; `model` is not a built, called
            `keras.Model` or cannot be copied (see `tfmp.to_float32`); `sample` does
            not fit the inputs (count, shape, dtype, finite values). Also, after
            writing, when TFLite cannot convert an op of the float32 copy (naming the
            op, the layer when known, and the converter's words, its error chained).
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
    path = export_checks.checked_path(path, format)
    copy = to_float32(model)  # refuses anything but a built keras.Model
    specs = export_checks.input_specs(copy)
    if len(specs) > 1 and functional_graph(copy) is None:
        raise _signature_mismatch(copy, [spec.name for spec in specs])
    flat = export_checks.checked_sample(sample, specs)
    with tempfile.TemporaryDirectory(prefix="tfmp_export_") as scratch:
        # Written beside first: an earlier export at `path` stays whole until the new one is.
        saved_model = os.path.join(scratch, "saved_model")
        copy.export(saved_model, format="tf_saved_model", verbose=False)
        names = _input_names(copy, artifacts.saved_model_inputs(saved_model))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if format == "tflite":
            with open(path, "wb") as file:
                file.write(_convert(copy, saved_model, weights))
            run = artifacts.run_tflite
        else:
            if os.path.isdir(path):
                shutil.rmtree(path)  # empty, or an earlier SavedModel (export_checks)
            shutil.move(saved_model, path)
            run = artifacts.run_saved_model
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
        raise ValueError(
            f"TFLite cannot convert the float32 copy of model {copy.name!r}{where}"
            f"{what}. The copy computes in float32, so this is an op TFLite's "
            "builtin kernels lack, not a mixed-precision one: replace the op in "
            "that layer, or, if the deployment can ship TensorFlow kernels, convert "
            "the SavedModel yourself with converter.target_spec.supported_ops "
            "including tf.lite.OpsSet.SELECT_TF_OPS. Converter said: "
            f"{first[:500]}"
        ) from error


def _layer_in_message(copy: keras.Model, message: str) -> Optional[str]:
    """The path of the layer named first in a converter location ``"<model>/<layer>/<op>@<fn>"``, or None.

    Name scopes may suffix a name (``"inverse_1"``), so an exact name wins at the same place.
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
    actual = [produced[key] for key in artifacts.output_order(produced)]
    if len(actual) != len(expected) or any(
        a.shape != e.shape for a, e in zip(actual, expected)
    ):
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
        size_bytes=artifacts.size_bytes(path),
        sample_rows=int(expected[0].shape[0]) if expected and expected[0].ndim else 0,
    )
