"""The export surface: what ``Model.export`` and the TFLite converter take and raise, and the converter's
``convert``.

Private accessors for `tfmp.export` (`tfmp._src.deployment`); one hook: subscriber
``enable.tflite_hint`` (`tfmp._src.deployment.tflite_hint`, while enabled: a plain converter's error
on a model still computing in 16 bits re-raised naming the dtype, the layer and ``tfmp.to_float32``).

| private name used | where in Keras / TensorFlow | what tfmp does with it |
|---|---|---|
| ``keras.src.export.export_utils.get_input_signature`` | ``keras/src/export/export_utils.py`` | `export_input_specs`: the inputs `Model.export` gives the serving signature, checked by `tfmp.export` before it writes |
| ``convert_phase.ConverterError`` | ``tensorflow/lite/python/convert_phase.py`` | `tflite_converter_error`: the one error type `TFLiteConverter.convert` raises, caught by `tfmp.export` |
| ``lite.TFLiteKerasModelConverterV2``, ``lite.TFLiteSavedModelConverterV2`` | ``tensorflow/lite/python/lite.py`` | `converter_classes`: what ``tf.lite.TFLiteConverter.from_keras_model`` / ``from_saved_model`` return, each with its own ``convert`` |
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import keras
import tensorflow as tf

from tfmp._src.keras_hooks import patches
from tfmp._src.keras_hooks import versions  # noqa: F401 (an unsupported pair fails at import)

SURFACE = patches.Surface("export", methods=("convert",), subscribers=("enable.tflite_hint",))

#: (what tfmp relies on TensorFlow doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = (
    ("tf.lite.TFLiteConverter.from_keras_model / from_saved_model / from_concrete_functions return instances of "
     "converter_classes(); their convert raises tflite_converter_error() naming the 16-bit tensor types of "
     "a model still computing in 16 bits (error_texts.converter_16bit_dtypes)",
     "tests/test_keras_hooks.py::test_the_tflite_converter_tfmp_hooks_still_raises_naming_16bit_tensor_types"),
)


def converter_classes() -> Tuple[type, ...]:
    """The converter classes ``tf.lite.TFLiteConverter``'s constructors return, each overriding ``convert``."""
    from tensorflow.lite.python import lite

    return (tf.lite.TFLiteConverter, lite.TFLiteKerasModelConverterV2, lite.TFLiteSavedModelConverterV2)


def subscribe_convert(wrap: Callable[[Callable], Callable], *, owner: str) -> List[patches.Hook]:
    """Hooks ``convert`` of each of `converter_classes` (see `patches.Surface.subscribe`)."""
    return patches.install_all([lambda cls=cls: SURFACE.subscribe(cls, "convert", wrap, owner=owner)
                                for cls in converter_classes()])


def tflite_converter_error() -> type:
    """The exception class `tf.lite.TFLiteConverter.convert` raises (not exported by `tf.lite`)."""
    from tensorflow.lite.python.convert_phase import ConverterError

    return ConverterError


def export_input_specs(model: Any) -> List[Any]:
    """The flat `keras.InputSpec`s `model.export` serves (Keras's ValueError for a subclassed model never called)."""
    from keras.src.export.export_utils import get_input_signature

    return keras.tree.flatten(get_input_signature(model))
