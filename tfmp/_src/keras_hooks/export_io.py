"""What ``Model.export`` and the TFLite converter take and raise, read before tfmp writes a deployment file.

No hook: private accessors only, for `tfmp.export` (`tfmp._src.deployment`).

| private name used | where in Keras / TensorFlow | what tfmp does with it |
|---|---|---|
| ``keras.src.export.export_utils.get_input_signature`` | ``keras/src/export/export_utils.py`` | `export_input_specs`: the inputs `Model.export` gives the serving signature, checked by `tfmp.export` before it writes |
| ``convert_phase.ConverterError`` | ``tensorflow/lite/python/convert_phase.py`` | `tflite_converter_error`: the one error type `TFLiteConverter.convert` raises, caught by `tfmp.export` |
"""

from __future__ import annotations

from typing import Any, List

import keras

from tfmp._src.keras_hooks import versions  # noqa: F401 (an unsupported pair fails at import)


def tflite_converter_error() -> type:
    """The exception class `tf.lite.TFLiteConverter.convert` raises (not exported by `tf.lite`)."""
    from tensorflow.lite.python.convert_phase import ConverterError

    return ConverterError


def export_input_specs(model: Any) -> List[Any]:
    """The flat `keras.InputSpec`s `model.export` serves (Keras's ValueError for a subclassed model never called)."""
    from keras.src.export.export_utils import get_input_signature

    return keras.tree.flatten(get_input_signature(model))
