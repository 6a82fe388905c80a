"""The backend-ops surface: the functions of Keras's TensorFlow backend that ``keras.ops`` calls.

``keras.ops`` looks ``gelu``, the convolutions (``conv``, ``conv_transpose``, ``depthwise_conv``,
``separable_conv``), ``sparse_categorical_crossentropy`` and ``add`` up on the backend module at
each call (`PLACES`), and Keras's dropout layers and ``keras.random.dropout`` look up
``backend.random.dropout``, so a hook on the module attribute sees every call. Each wrapper hands its
subscriber an `OpCall`; the subscriber returns `KERAS` for a call it leaves to Keras.

| private name used | where in Keras | what tfmp does with it |
|---|---|---|
| ``keras.src.backend.tensorflow.nn`` (3.12-3.15, ``backend.nn``), ``...tensorflow.ops.nn`` (3.16, ``backend.ops.nn``) | ``keras/src/backend/tensorflow/[ops/]nn.py``, ``keras/src/ops/nn.py`` | `backend_nn`: the module whose ``gelu``, ``conv``, ``conv_transpose``, ``depthwise_conv``, ``separable_conv``, ``sparse_categorical_crossentropy`` are hooked |
| ``keras.src.backend.tensorflow.random`` (3.12-3.16, ``backend.random``); its ``dropout`` calls ``tf.nn.experimental.stateless_dropout``, which draws its uniform noise in the input's dtype | ``keras/src/backend/tensorflow/random.py``, ``keras/src/random/random.py``, ``keras/src/layers/regularization/dropout.py``, ``spatial_dropout.py`` | `backend_random`: the module whose ``dropout`` is hooked |
| ``keras.src.backend.tensorflow.numpy`` (3.12-3.15, ``backend.numpy``), ``...tensorflow.ops.numpy`` (3.16, ``backend.ops.numpy``); its ``add`` takes ``tf.nn.bias_add`` for a bias vector | ``keras/src/backend/tensorflow/[ops/]numpy.py``, ``keras/src/ops/numpy.py`` | `backend_numpy`: the module whose ``add`` is hooked |
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

from tfmp._src.keras_hooks import patches

SURFACE = patches.Surface(
    "backend ops",
    methods=("gelu", "conv", "conv_transpose", "depthwise_conv", "separable_conv", "sparse_categorical_crossentropy",
             "add", "dropout"),
    subscribers=("gelu", "conv", "cross_entropy", "bias_gradient", "dropout"),
)

#: (what tfmp relies on Keras doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = (
    ("keras.ops.gelu (so activation='gelu', keras.activations.gelu, Activation('gelu')) calls "
     "gelu(x, approximate) looked up on backend.nn (Keras 3.12-3.15) or backend.ops.nn (3.16) at each call",
     "tests/test_gelu.py::test_where_the_16_bit_gelu_is_slow_a_model_computes_its_exact_gelus_in_float32_only"),
    ("keras.ops.conv, conv_transpose, depthwise_conv and separable_conv (so Conv1D/2D/3D, their "
     "transposes, DepthwiseConv1D/2D and SeparableConv1D/2D) call conv(inputs, kernel, ...), "
     "conv_transpose(inputs, kernel, ...), depthwise_conv(inputs, kernel, ...) and "
     "separable_conv(inputs, depthwise_kernel, pointwise_kernel, ...) looked up on backend.nn "
     "(Keras 3.12-3.15) or backend.ops.nn (3.16) at each call",
     "tests/test_conv.py::test_keras_still_calls_the_backend_convolutions_by_module_attribute"),
    ("keras.losses.SparseCategoricalCrossentropy and keras.ops.sparse_categorical_crossentropy call "
     "sparse_categorical_crossentropy(target, output, from_logits, axis) looked up on backend.nn "
     "(Keras 3.12-3.15) or backend.ops.nn (3.16) at each call, with the logits cast to float32 by "
     "Loss.__call__ (a Cast op in a traced step)",
     "tests/test_cross_entropy.py::test_keras_still_calls_the_backend_cross_entropy_on_logits_cast_to_float32"),
    ("keras.ops.add (so Dense's and the convolutions' bias) calls add(x1, x2) looked up on "
     "backend.numpy (Keras 3.12-3.15) or backend.ops.numpy (3.16) at each call, which adds a bias "
     "vector with tf.nn.bias_add",
     "tests/test_bias_gradient.py::test_keras_still_calls_the_backend_add_by_module_attribute"),
    ("keras.random.dropout, Dropout and SpatialDropout1D/2D/3D call dropout(inputs, rate, noise_shape, seed) "
     "looked up on backend.random at each call, which draws its uniform noise in the inputs' dtype",
     "tests/test_dropout_draw.py::test_keras_still_calls_the_backend_dropout_by_module_attribute"),
)


#: Attribute paths on ``keras.src.backend`` of each module ``keras.ops`` reads, newest first.
PLACES: Dict[str, Tuple[str, ...]] = {
    "nn": ("ops.nn", "nn"),  # Keras 3.16: backend.ops.nn; 3.12-3.15: backend.nn
    "numpy": ("ops.numpy", "numpy"),  # Keras 3.16: backend.ops.numpy; 3.12-3.15: backend.numpy
    "random": ("random",),  # Keras 3.12-3.16: backend.random
}


def _backend_module(kind: str) -> Any:
    """The backend module `kind` at the first of its `PLACES` the installed Keras has; AttributeError if none."""
    from keras.src import backend

    for path in PLACES[kind]:
        try:
            return operator.attrgetter(path)(backend)
        except AttributeError:
            continue
    raise AttributeError(
        f"module 'keras.src.backend' has none of {', '.join(PLACES[kind])} (the backend's {kind} module "
        "keras.ops calls)")


def backend_numpy() -> Any:
    """The backend module whose ``add`` ``keras.ops.add`` calls (AttributeError if moved)."""
    return _backend_module("numpy")


def backend_nn() -> Any:
    """The backend module whose ``gelu`` and convolutions ``keras.ops`` calls (AttributeError if moved)."""
    return _backend_module("nn")


def backend_random() -> Any:
    """The backend module whose ``dropout`` the dropout layers and ``keras.random`` call (AttributeError if moved)."""
    return _backend_module("random")


def module_of(function: str) -> Any:
    """The backend module whose attribute `function` (one of `SURFACE.methods`) Keras reads."""
    if function == "add":
        return backend_numpy()
    return backend_random() if function == "dropout" else backend_nn()


#: The parameters of each hooked backend function its wrapper names, in Keras's order (tested).
FUNCTION_SIGNATURES: Dict[str, Tuple[str, ...]] = {
    "gelu": ("x", "approximate"),
    "conv": ("inputs", "kernel"),
    "conv_transpose": ("inputs", "kernel"),
    "depthwise_conv": ("inputs", "kernel"),
    "separable_conv": ("inputs", "depthwise_kernel", "pointwise_kernel"),
    "sparse_categorical_crossentropy": ("target", "output", "from_logits", "axis"),
    "add": ("x1", "x2"),
    "dropout": ("inputs", "rate", "noise_shape", "seed"),
}


class OpCall(NamedTuple):
    """One call of a hooked backend function, as its subscriber sees it.

    Attributes:
        inputs: Tuple of tensors: ``(x,)`` for ``gelu``, ``(inputs, kernel)`` for the
            convolutions but ``(inputs, depthwise_kernel, pointwise_kernel)`` for
            ``separable_conv`` (`FUNCTION_SIGNATURES`), ``(target, output)`` for
            ``sparse_categorical_crossentropy``, ``(x1, x2)`` for ``add``, ``(inputs,)`` for ``dropout``.
        exact: Bool. ``gelu``: ``approximate=False`` was asked; ``sparse_categorical_crossentropy``:
            ``from_logits=True`` on the last axis; True for the others.
        keras: Callable on as many tensors as `inputs`: Keras's function, other arguments as given.
        options: Dict or None. ``dropout``: its other arguments by name (``rate``, ``noise_shape``,
            ``seed``, as given); None for the others.
    """

    inputs: Tuple[Any, ...]
    exact: bool
    keras: Callable[..., Any]
    options: Optional[Dict[str, Any]] = None


#: What a subscriber returns for a call it leaves to Keras.
KERAS = object()


def _wrapper(function: str, replace: Callable[[OpCall], Any]) -> Callable[[Callable], Callable]:
    """The hook factory of `function`: Keras's signature on the outside, an `OpCall` to `replace` inside."""

    def run(call: OpCall) -> Any:
        result = replace(call)
        return call.keras(*call.inputs) if result is KERAS else result

    def wrap(next_function: Callable) -> Callable:
        if function == "gelu":
            def gelu(x: Any, approximate: bool = True) -> Any:
                return run(OpCall((x,), not approximate, lambda x: next_function(x, approximate)))

            hooked = gelu
        elif function == "add":
            def add(x1: Any, x2: Any) -> Any:
                return run(OpCall((x1, x2), True, next_function))

            hooked = add
        elif function == "sparse_categorical_crossentropy":
            def sparse_categorical_crossentropy(target: Any, output: Any, from_logits: bool = False,
                                                axis: int = -1) -> Any:
                rank = getattr(getattr(output, "shape", None), "rank", None)
                last = axis == -1 or (rank is not None and axis == rank - 1)
                return run(OpCall((target, output), bool(from_logits) and last,
                                  lambda target, output: next_function(target, output, from_logits, axis)))

            hooked = sparse_categorical_crossentropy
        elif function == "dropout":  # the rate, noise shape and seed pass as given
            def dropout(inputs: Any, *args: Any, **kwargs: Any) -> Any:
                options = {"noise_shape": None, "seed": None,
                           **dict(zip(FUNCTION_SIGNATURES["dropout"][1:], args)), **kwargs}
                return run(OpCall((inputs,), True, lambda x: next_function(x, *args, **kwargs), options))

            hooked = dropout
        else:  # the convolutions: their tensors (`FUNCTION_SIGNATURES`) first, the other arguments as given
            names = FUNCTION_SIGNATURES[function]

            def convolution(*args: Any, **kwargs: Any) -> Any:
                tensors = args[:len(names)] + tuple(kwargs.pop(name) for name in names[len(args):])
                rest = args[len(names):]
                return run(OpCall(tensors, True, lambda *given: next_function(*given, *rest, **kwargs)))

            hooked = convolution
        return functools.wraps(next_function)(hooked)

    return wrap


def subscribe(function: str, replace: Callable[[OpCall], Any], *, owner: str) -> patches.Hook:
    """Routes every call of backend `function` through ``replace(OpCall)`` (returning a result or `KERAS`).

    AttributeError where Keras moved the module or function: the caller switches its feature off.
    """
    return SURFACE.subscribe(module_of(function), function, _wrapper(function, replace), owner=owner)
