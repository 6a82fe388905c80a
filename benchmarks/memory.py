"""Memory per configuration: tfmp's tensor-size estimate, and peak device memory where TF has it.

Byte counts come from `tfmp.estimate_memory` on the built, compiled and warmed-up
model, with ``policy=None`` so that every layer output is counted at the dtype it
really has (float32 where tfmp forced a layer, 16 bits elsewhere under a mixed
policy):

* ``parameter_bytes``: every model variable at its own dtype (float32 master
  weights under mixed policies, so the same as under float32); exact.
* ``gradient_bytes``: one gradient per trainable variable; exact.
* ``optimizer_bytes``: every optimizer variable (Adam's two slots per weight,
  its scalars, and `tfmp.LossScaleOptimizer`'s scale and counters); exact.
* ``activation_bytes``: one output per layer for one batch; an estimate, a lower
  bound of what backpropagation keeps (see `tfmp.estimate_memory`).
* ``peak_device_bytes``: growth of TensorFlow's peak allocation on the first GPU
  while the configuration was built and warmed up
  (``tf.config.experimental.get_memory_info``); None on a machine without GPU,
  where TensorFlow does not track it.
"""

from __future__ import annotations

from typing import Optional

import keras
import tensorflow as tf

import tfmp

FIELDS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes")


def model_memory(model: keras.Model, batch_size: int) -> dict:
    """Byte counts of a built, compiled model, from `tfmp.estimate_memory`.

    Args:
        model: Built functional `keras.Model`, compiled, its optimizer built
            (after a training step).
        batch_size: Int. Samples per batch for the activations.

    Returns:
        Dict with the ints of `FIELDS`.
    """
    estimate = tfmp.estimate_memory(model, batch_size=batch_size)
    return {field: getattr(estimate, field) for field in FIELDS}


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
