"""The backend-ops surface: the functions of Keras's TensorFlow backend that ``keras.ops`` calls.

``keras.ops.gelu``, ``conv`` and ``conv_transpose`` look their backend function up on the
backend's nn module, ``keras.ops.add`` on its numpy module, at each call (`PLACES`): a
hook on the module's attribute sees every such call in the process, so each subscriber
decides per call from the attachment of the calling layer (`layer_calls.calling_layer`)
and hands any other call on unchanged. Subscribers, innermost first (`SURFACE`):
``gelu`` (`tfmp._src.float32.gelu`), ``conv`` (`tfmp._src.float32.conv`),
``bias_gradient`` (`tfmp._src.float32.bias_gradient`); all optional features, switched
off with one warning (`availability`) where a Keras release moved what they hook.

| private name used | where in Keras | what tfmp does with it |
|---|---|---|
| ``keras.src.backend.tensorflow.nn`` (Keras 3.12-3.15: the module ``keras.ops.gelu`` reads ``gelu`` from at each call, as ``backend.nn``) | ``keras/src/backend/tensorflow/nn.py``, ``keras/src/ops/nn.py`` | `backend_nn`: the module whose ``gelu``, ``conv`` and ``conv_transpose`` are hooked |
| ``keras.src.backend.tensorflow.ops.nn`` (Keras 3.16: the same module moved, read as ``backend.ops.nn``) | ``keras/src/backend/tensorflow/ops/nn.py``, ``keras/src/ops/nn.py`` | `backend_nn`, as above |
| ``keras.src.backend.tensorflow.numpy`` (Keras 3.12-3.15: the module ``keras.ops.add`` reads ``add`` from at each call, as ``backend.numpy``; its ``add`` takes ``tf.nn.bias_add`` for a bias vector) | ``keras/src/backend/tensorflow/numpy.py``, ``keras/src/ops/numpy.py`` | `backend_numpy`: the module whose ``add`` is hooked |
| ``keras.src.backend.tensorflow.ops.numpy`` (Keras 3.16: the same module moved, read as ``backend.ops.numpy``) | ``keras/src/backend/tensorflow/ops/numpy.py``, ``keras/src/ops/numpy.py`` | `backend_numpy`, as above |
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Tuple

from tfmp._src.keras_hooks import patches

Hook = patches.Hook  # what subscribing returns: `.remove()` unsubscribes
SURFACE = patches.Surface(
    "backend ops",
    methods=("gelu", "conv", "conv_transpose", "add"),
    subscribers=("gelu", "conv", "bias_gradient"),
)

#: (what tfmp relies on Keras doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = (
    ("keras.ops.gelu (so activation='gelu', keras.activations.gelu, Activation('gelu')) calls "
     "gelu(x, approximate) looked up on backend.nn (Keras 3.12-3.15) or backend.ops.nn (3.16) at each call",
     "tests/test_gelu.py::test_where_the_16_bit_gelu_is_slow_a_model_computes_its_exact_gelus_in_float32_only"),
    ("keras.ops.conv and conv_transpose (so Conv1D/2D/3D and their transposes) call "
     "conv(inputs, kernel, ...) and conv_transpose(inputs, kernel, ...) looked up on backend.nn "
     "(Keras 3.12-3.15) or backend.ops.nn (3.16) at each call",
     "tests/test_conv.py::test_keras_still_calls_the_backend_convolutions_by_module_attribute"),
    ("keras.ops.add (so Dense's and the convolutions' bias) calls add(x1, x2) looked up on "
     "backend.numpy (Keras 3.12-3.15) or backend.ops.numpy (3.16) at each call, which adds a bias "
     "vector with tf.nn.bias_add",
     "tests/test_bias_gradient.py::test_keras_still_calls_the_backend_add_by_module_attribute"),
)


#: Where ``keras.ops`` finds each backend module: ``"nn"`` or ``"numpy"`` -> attribute
#: paths on ``keras.src.backend``, the newest release's first. A path present is the
#: module ``keras.ops`` reads (the contract tests in `CALL_ORDER` check it on the
#: installed pair).
PLACES: Dict[str, Tuple[str, ...]] = {
    "nn": ("ops.nn", "nn"),  # Keras 3.16: backend.ops.nn; 3.12-3.15: backend.nn
    "numpy": ("ops.numpy", "numpy"),  # Keras 3.16: backend.ops.numpy; 3.12-3.15: backend.numpy
}


def _backend_module(kind: str) -> Any:
    """The backend module `kind` (a key of `PLACES`) at the first of its paths the installed Keras has.

    Raises:
        AttributeError: none of its paths exists (Keras moved it again).
    """
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
    """The module of Keras's TensorFlow backend ops that ``keras.ops.add`` calls.

    ``backend.ops.numpy`` from Keras 3.16, ``backend.numpy`` before (`PLACES`).

    Raises:
        AttributeError: the installed Keras has it at neither place.
    """
    return _backend_module("numpy")


def backend_nn() -> Any:
    """The module of Keras's TensorFlow backend ops that ``keras.ops.gelu``, ``conv`` and ``conv_transpose`` call.

    ``backend.ops.nn`` from Keras 3.16, ``backend.nn`` before (`PLACES`).

    Raises:
        AttributeError: the installed Keras has it at neither place.
    """
    return _backend_module("nn")


def module_of(function: str) -> Any:
    """The backend module whose attribute `function` (one of `SURFACE.methods`) ``keras.ops`` reads.

    Raises:
        AttributeError: the installed Keras has that module at none of its `PLACES`.
    """
    return backend_numpy() if function == "add" else backend_nn()


def subscribe(function: str, wrap: Callable[[Callable], Callable], *, owner: str) -> patches.Hook:
    """Hooks the backend function `function` for subscriber `owner` (see `patches.Surface.subscribe`).

    Raises:
        KeyError: `function` or `owner` is not of this surface.
        AttributeError: Keras moved the backend module or the function (the caller
            switches its feature off, `availability`).
    """
    return SURFACE.subscribe(module_of(function), function, wrap, owner=owner)
