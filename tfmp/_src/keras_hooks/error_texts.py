"""The Keras and TensorFlow error texts and traceback frames tfmp reads, in one place.

tfmp explains dtype mismatches (`tfmp._src.float32.dtype_errors`) and sorts `tfmp.audit`'s batch
failures by these texts; each is a contract, produced on the installed pair by
``tests/test_keras_hooks.py`` so a reworded message fails there by name.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import tensorflow as tf

#: TensorFlow's spellings of float dtypes in its messages ("float" is float32).
_DTYPE_NAMES = {"half": "float16", "float": "float32", "double": "float64", "bfloat16": "bfloat16",
                "float16": "float16", "float32": "float32", "float64": "float64"}
_NAME = r"(?:tf\.)?(\w+)"

#: TensorFlow's texts for tensors of different dtypes in one op: name -> (error class, first-line pattern).
DTYPE_MISMATCH: Dict[str, Tuple[type, "re.Pattern[str]"]] = {
    # tf.function(lambda a, b: a * b) on a bfloat16 and a float32 tensor:
    # "Input 'y' of 'Mul' Op has type float32 that does not match type bfloat16 of argument 'x'."
    "graph op": (TypeError, re.compile(rf"has type {_NAME} that does not match type {_NAME}")),
    # tf.raw_ops.Mul eagerly: "cannot compute Mul as input #1(zero-based) was expected to be a bfloat16 tensor
    # but is a float tensor [Op:Mul] name: "
    "eager op": (tf.errors.InvalidArgumentError,
                 re.compile(rf"was expected to be an? {_NAME} tensor but is an? {_NAME} tensor")),
    # tf.convert_to_tensor(float32 tensor, dtype="bfloat16"):
    # "Tensor conversion requested dtype bfloat16 for Tensor with dtype float32: <tf.Tensor ..."
    "conversion": (ValueError, re.compile(rf"requested dtype {_NAME} for Tensor with dtype {_NAME}")),
    # tf.concat([bfloat16, float32], 0) in a graph: "... have types [bfloat16, float32] that don't all match."
    "list op": (TypeError, re.compile(r"have types \[([\w, ]+)\] that don't all match")),
    # A bfloat16 tensor divided by a float32 one (tf.math.truediv, eager or graph):
    # "`x` and `y` must have the same dtype, got tf.bfloat16 != tf.float32."
    "division": (TypeError, re.compile(rf"must have the same dtype, got {_NAME} != {_NAME}")),
}

#: TensorFlow's TypeError building an op whose definition refuses a 16-bit dtype (``tf.linalg.inv`` of a
#: bfloat16 tensor in a graph): "Value passed to parameter 'input' has DataType bfloat16 not in list of
#: allowed values: float64, float32, float16, complex64, complex128". ``keras.ops.linalg.cholesky`` and
#: ``lu_factor`` raise it again as a ValueError ("Cholesky decomposition failed: Value passed ...").
REFUSED_DTYPE = re.compile(r"has DataType (b?float16) not in list of allowed values")

#: Keras's texts naming the layer that raised: name -> pattern.
KERAS_TEXTS: Dict[str, "re.Pattern[str]"] = {
    # An error in a layer's call, re-raised by Keras's traceback filter.
    "call": re.compile(r"Exception encountered when calling (\w+)\.call\(\)"),
    # Inferring a layer's output spec: "Could not automatically infer the output shape / dtype of 'noise'
    # (of type Noise)."
    "output spec": re.compile(r"of '([^']+)' \(of type (\w+)\)"),
}

#: Keras's NotImplementedError when a Lambda without ``output_shape`` fails its shape inference
#: (``Lambda.compute_output_shape``): its bare ``except`` drops the cause, left as the error's ``__context__``.
LAMBDA_SHAPE = re.compile(r"could not automatically infer the shape of the Lambda's output")


def swallowed_by_lambda(error: BaseException) -> Optional[BaseException]:
    """The error Keras's `LAMBDA_SHAPE` text replaced (the Lambda function's own), or None for any other."""
    if isinstance(error, NotImplementedError) and LAMBDA_SHAPE.search(str(error)):
        return error.__cause__ or error.__context__
    return None


#: The TFLite converter's MLIR tensor types in its ``ConverterError`` ("tf.MatMul(tensor<?x4xbf16>, ...)"): a
#: 16-bit element type names an op still computing in 16 bits, which TFLite's builtin kernels lack.
_CONVERTER_16BIT = re.compile(r"tensor<(?:[^<>]*x)?(bf16|f16)>")
_CONVERTER_DTYPES = {"bf16": "bfloat16", "f16": "float16"}


def converter_16bit_dtypes(message: str) -> List[str]:
    """The 16-bit dtypes (Keras names, sorted) of the tensor types a TFLite converter error names; [] if none."""
    return sorted({_CONVERTER_DTYPES[match] for match in _CONVERTER_16BIT.findall(message)})


#: The converter's location of an op: ``fused["MatMul:", "sequential_1/dense_1/MatMul@__inference_..."]``
#: (TensorFlow 2.17-2.21) or ``fused["MatMul:", "sequential_1/dense_1/MatMul"]`` (2.23 pre-releases): its
#: scopes, then the op.
_CONVERTER_LOCATION = re.compile(r'"((?:[\w.-]+/)+)[\w.-]+(?:@|")')


def converter_first_scope(message: str) -> Optional[str]:
    """The name scope of the first op a TFLite converter error locates (``"sequential_1/dense_1"``: Keras's
    layer names, suffixed by TensorFlow when traced again); None if none."""
    match = _CONVERTER_LOCATION.search(message)
    return match.group(1).rstrip("/") if match else None


#: Keras's ValueError refusing ``model.quantize("int8")`` for a float16 layer (``Layer._check_quantize_args``).
QUANTIZE_FLOAT16 = re.compile(r"Quantization mode='(\w+)' doesn't work well with compute_dtype='float16'")

#: TensorFlow's ValueError reducing a structure of distributed values under a multi-worker strategy
#: (``strategy.reduce`` in Keras's ``_maybe_symbolic_build`` on ``fit``'s first batch, `multi_worker`):
#: "Attempt to convert a value (PerReplica:{...}) with an unsupported type (<class ...>) to a Tensor."
PER_REPLICA_CONVERSION = re.compile(r"Attempt to convert a value \(.*PerReplica:.*\) with an unsupported type", re.S)


def refused_dtype(error: BaseException) -> Optional[str]:
    """The 16-bit dtype a `REFUSED_DTYPE` text in `error` (a TypeError or ValueError) names, or None."""
    match = isinstance(error, (TypeError, ValueError)) and REFUSED_DTYPE.search(str(error))
    return match.group(1) if match else None


def is_per_replica_conversion(error: BaseException) -> bool:
    return isinstance(error, ValueError) and PER_REPLICA_CONVERSION.search(str(error)) is not None


def mismatched_dtypes(message: str) -> Optional[Tuple[str, str]]:
    """The two float dtypes (Keras names, in the text's order) a `DTYPE_MISMATCH` text in `message` names, or None."""
    for _, pattern in DTYPE_MISMATCH.values():
        match = pattern.search(message)
        if match:
            names = [n for group in match.groups() for n in group.split(", ")]
            floats = list(dict.fromkeys(_DTYPE_NAMES.get(n.removeprefix("tf.")) for n in names))
            if len(floats) == 2 and None not in floats:
                return floats[0], floats[1]
    return None


def is_dtype_mismatch(error: BaseException, first_line: str) -> bool:
    """Bool. Whether `error` (of its class) with first line `first_line` is a dtype mismatch."""
    return any(isinstance(error, cls) and pattern.search(first_line)
               for cls, pattern in DTYPE_MISMATCH.values())


def layer_named_by_keras(message: str) -> Tuple[Optional[str], Optional[str]]:
    """(layer name, layer class) from Keras's texts in `message`; None for what they do not say."""
    spec = KERAS_TEXTS["output spec"].search(message)
    if spec:
        return spec.group(1), spec.group(2)
    call = KERAS_TEXTS["call"].search(message)
    return None, (call.group(1) if call else None)


def call_frame_owners(error: BaseException) -> Iterator[Any]:
    """The ``self`` of each frame of `error`'s traceback running a ``call`` (user code Keras's filter keeps)."""
    for frame in frames_innermost_first(error):
        if frame.f_code.co_name == "call" and "self" in frame.f_locals:
            yield frame.f_locals["self"]


def frames_innermost_first(error: BaseException) -> List[Any]:
    """The frames of `error`'s traceback, the innermost first."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[::-1]


#: TensorFlow's frame running a built-in op's gradient for a tape (``backprop._gradient_function``): its locals
#: name the forward op's scope (``"sequential_1/dense_1/MatMul"``; None eagerly) and hold the incoming
#: gradients. Read where the error is caught: TensorFlow's traceback filter later drops these frames.
GRADIENT_FRAME = ("_gradient_function", "forward_pass_name_scope", "out_grads")


def gradient_frames(error: BaseException) -> Iterator[Tuple[str, Tuple[str, ...]]]:
    """(forward op's name scope, incoming gradients' dtype names) of each `GRADIENT_FRAME`, innermost first."""
    function, scope_name, grads_name = GRADIENT_FRAME
    for frame in frames_innermost_first(error):
        if frame.f_code.co_name == function and grads_name in frame.f_locals:
            grads = frame.f_locals.get(grads_name) or ()
            yield frame.f_locals.get(scope_name) or "", tuple(getattr(getattr(g, "dtype", None), "name", "") for g in grads)


#: The name scopes TensorFlow puts a traced backward pass's ops in: ``"gradient_tape/<forward op's scope>/"``
#: for a tape (``backprop._gradient_function``), ``"gradients"`` (``"gradients_1"``, ...) for `tf.gradients`.
BACKWARD_PASS_SCOPE = re.compile(r"gradient_tape|gradients(_\d+)?")


def in_backward_pass(op_name: str) -> bool:
    """Whether a graph op's name puts it in a backward pass (`BACKWARD_PASS_SCOPE`), not in the user's code."""
    return any(BACKWARD_PASS_SCOPE.fullmatch(part) for part in op_name.split("/"))
