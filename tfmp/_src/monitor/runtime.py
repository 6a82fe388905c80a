"""Device memory for `tfmp.LossScaleMonitor`, from `tf.config.experimental.get_memory_info` (GPUs only)."""

from __future__ import annotations

from typing import Dict, Tuple

import tensorflow as tf


def device_memory() -> Dict[str, Tuple[int, int]]:
    """Device name (``"GPU:0"``) -> (bytes in use, peak bytes) of each visible GPU that reports them."""
    result = {}
    for device in tf.config.list_logical_devices("GPU"):
        name = device.name.split("device:")[-1]
        try:
            info = tf.config.experimental.get_memory_info(name)
        except ValueError:  # raised for devices without an allocator that reports
            continue
        result[name] = (int(info["current"]), int(info["peak"]))
    return result
