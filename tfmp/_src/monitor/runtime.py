"""Device memory for `tfmp.LossScaleMonitor`.

Device memory comes from `tf.config.experimental.get_memory_info`, which
TensorFlow fills in for GPUs only (on a CPU it returns zeros).
"""

from __future__ import annotations

from typing import Dict, Tuple

import tensorflow as tf



def device_memory() -> Dict[str, Tuple[int, int]]:
    """Memory in use and its peak on each visible GPU, in bytes.

    Returns:
        Dict from device name (``"GPU:0"``) to (current bytes, peak bytes); empty
        when no GPU is visible or TensorFlow reports none (CPU-only machines).
    """
    result = {}
    for device in tf.config.list_logical_devices("GPU"):
        name = device.name.split("device:")[-1]
        try:
            info = tf.config.experimental.get_memory_info(name)
        except ValueError:  # raised for devices without an allocator that reports
            continue
        result[name] = (int(info["current"]), int(info["peak"]))
    return result
