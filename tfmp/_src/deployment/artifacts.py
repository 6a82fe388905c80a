"""Running a written SavedModel or TFLite file as a deployment runs it.

Both go through their ``serving_default`` signature, the entry point serving systems
call, with inputs and outputs by name.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Dict, List

import numpy as np
import tensorflow as tf

SIGNATURE = "serving_default"


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
