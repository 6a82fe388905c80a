"""Reading TensorBoard event files back, with TensorBoard's own EventAccumulator."""

import glob

import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2


def read_run(log_dir):
    """{tag: [(step, value), ...]} over every event file in log_dir/train.

    Scalars give floats, texts strings, the custom-scalars layout its proto, other
    plugins' tensors (e.g. Keras's model config) numpy arrays.
    """
    files = sorted(glob.glob(f"{log_dir}/train/events.out.tfevents.*"))
    result = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
            for event in acc.Tensors(tag):
                value = tf.make_ndarray(event.tensor_proto)
                if plugin == "scalars":
                    value = float(value)
                elif plugin == "text":
                    value = value.item().decode()
                elif plugin == "custom_scalars":
                    value = layout_pb2.Layout.FromString(value.item())
                result.setdefault(tag, []).append((event.step, value))
    return result


def steps(run, tag):
    return [step for step, _ in run[tag]]


def values(run, tag):
    return [value for _, value in run[tag]]
