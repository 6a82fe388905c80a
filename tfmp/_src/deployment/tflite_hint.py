"""A plain ``tf.lite.TFLiteConverter`` on a model still computing in 16 bits: the dtype, layer and route named.

TFLite's builtin kernels have no bfloat16 or float16 ops, so converting a mixed model (``from_keras_model``,
``from_saved_model`` of its export, Keras's ``export(format="litert")``) fails with a converter error that
lists ops and MLIR types only. While tfmp is enabled, `install` hooks the converters' ``convert`` (owner
``"enable.tflite_hint"``): such an error is raised again, same type, naming the 16-bit dtype, the first
layer the converter locates and ``tfmp.to_float32`` / ``tfmp.export``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional

from tfmp._src.errors import opening
from tfmp._src.float32.dtype_errors import explained, with_explanation
from tfmp._src.keras_hooks import error_texts, export_io, surfaces

#: The troubleshooting guide's section on converting a 16-bit model (also `quantize_hint`'s).
SECTION = "converting-or-quantizing-a-16-bit-model"
def hint(message: str) -> Optional[str]:
    """The text tfmp appends to a converter error naming 16-bit tensors (`errors.opening`); None for any other
    error."""
    low = error_texts.converter_16bit_dtypes(message)
    if not low:
        return None
    scope = error_texts.converter_first_scope(message)
    where = f" (first in the ops of {scope!r})" if scope else ""
    dtypes = " and ".join(low)
    return "tfmp: " + opening(
        f"The model converted still computes in {dtypes}{where}.",
        "Trained under a mixed policy, it keeps its 16-bit compute dtype; "
        f"TFLite's builtins have no {' or '.join(low)} ops.",
        "Fix: TFLiteConverter.from_keras_model(tfmp.to_float32(model)), "
        "or tfmp.export(model, 'model.tflite', format='tflite').",
        SECTION)


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def tfmp_convert(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except export_io.tflite_converter_error() as error:
            text = None if explained(error) else hint(str(error))
            if text is None:
                raise
            raise with_explanation(error, text) from error

    return tfmp_convert


def install() -> List[surfaces.Hook]:
    """Hooks the TFLite converters' ``convert``; remove the hooks to undo."""
    return export_io.subscribe_convert(_wrap, owner="enable.tflite_hint")
