"""Memory per configuration: tensor-size counts, and peak device memory where TF has it.

Byte counts come from the built objects (``tfmp.estimate_memory`` lives on another
branch; this is the suite's own small count, independent of it):

* ``parameter_bytes``: every model variable at its own dtype (float32 master
  weights under mixed policies, so the same as under float32).
* ``optimizer_bytes``: every optimizer variable (Adam's two slots per weight,
  its scalars, and `tfmp.LossScaleOptimizer`'s scale and counters).
* ``activation_bytes``: one output tensor per layer or op of the functional graph,
  at the dtype it really has (16-bit under a mixed policy, float32 where a layer
  computes in float32), for one batch. Tensors inside a layer's `call` (e.g.
  attention scores inside `MultiHeadAttention`), gradients and workspaces are not
  counted: read it as the activations backpropagation keeps between layers, a
  lower bound of the true footprint.
* ``peak_device_bytes``: growth of TensorFlow's peak allocation on the first GPU
  while the configuration was built and warmed up
  (``tf.config.experimental.get_memory_info``); None on a machine without GPU,
  where TensorFlow does not track it.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import keras
import tensorflow as tf


def _bytes(shape: Iterable[Optional[int]], dtype: str) -> int:
    size = math.prod(int(d) for d in shape)
    return size * tf.as_dtype(keras.backend.standardize_dtype(dtype)).size


def variables_bytes(variables: Iterable) -> int:
    """Int. Bytes of `variables` at their dtypes, each variable counted once."""
    unique = {id(v): v for v in variables}
    return sum(_bytes(v.shape, v.dtype) for v in unique.values())


def activation_bytes(model: keras.Model, batch_size: int) -> int:
    """Bytes of the outputs of every layer and op of a functional `model`.

    Args:
        model: Functional `keras.Model` (its operations have symbolic outputs).
        batch_size: Int. Samples per batch; replaces the batch dimension.

    Returns:
        Int, bytes at each output's own dtype. Input layers are not counted.
    """
    total = 0
    for operation in model.operations:
        if isinstance(operation, keras.layers.InputLayer):
            continue
        for tensor in keras.tree.flatten(operation.output):
            shape = [batch_size] + list(tensor.shape[1:])
            total += _bytes(shape, tensor.dtype)
    return total


def model_memory(model: keras.Model, batch_size: int) -> dict:
    """Byte counts of a built, compiled model (see the module docstring).

    Args:
        model: Functional `keras.Model` whose optimizer is built (after a step).
        batch_size: Int. Samples per batch for the activations.

    Returns:
        Dict with ints ``parameter_bytes``, ``optimizer_bytes``,
        ``activation_bytes``.
    """
    return {
        "parameter_bytes": variables_bytes(model.variables),
        "optimizer_bytes": variables_bytes(model.optimizer.variables),
        "activation_bytes": activation_bytes(model, batch_size),
    }


class PeakDeviceMemory:
    """Growth of TensorFlow's peak allocation on the first GPU since construction.

    On a machine without GPU `read()` returns None: TensorFlow tracks no peak for
    the CPU allocator.
    """

    def __init__(self) -> None:
        gpus = tf.config.list_logical_devices("GPU")
        self.device: Optional[str] = "GPU:0" if gpus else None
        self.start = 0
        if self.device:
            tf.config.experimental.reset_memory_stats(self.device)
            self.start = tf.config.experimental.get_memory_info(self.device)["current"]

    def read(self) -> Optional[int]:
        """Int bytes the peak rose above the allocation at construction, or None."""
        if not self.device:
            return None
        return tf.config.experimental.get_memory_info(self.device)["peak"] - self.start
