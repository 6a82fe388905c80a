"""LossScaleMonitor: scalars read back with TensorBoard's own event reader."""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import tfmp


def read_scalars(log_dir):
    """Returns {tag: [(step, value), ...]} from the event files in log_dir/train."""
    files = glob.glob(f"{log_dir}/train/events.out.tfevents.*")
    assert files, f"no event files in {log_dir}/train"
    result = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"tensors": 0, "scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            events = acc.Tensors(tag)
            result.setdefault(tag, []).extend(
                (e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events
            )
    return result


def tiny_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    return model


def data(n=32):
    rng = np.random.default_rng(0)
    return rng.random((n, 4), dtype="float32"), rng.random((n, 1), dtype="float32")


@pytest.mark.parametrize("policy, scale", [("mixed_float16", 2.0**10), ("mixed_bfloat16", 1.0), ("float32", 1.0)])
def test_per_batch_scalars(tmp_path, policy, scale):
    options = {"initial_scale": scale} if policy == "mixed_float16" else {}
    with tfmp.policy_scope(policy, loss_scale_options=options):
        model = tiny_model()
        model.compile(optimizer="sgd", loss="mse")
        x, y = data()
        model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                  callbacks=[tfmp.LossScaleMonitor(tmp_path, update_freq="batch")])
    scalars = read_scalars(tmp_path)
    assert [s for s, _ in scalars["batch_loss_scale"]] == list(range(1, 9))
    assert {v for _, v in scalars["batch_loss_scale"]} == {scale}
    assert {v for _, v in scalars["batch_overflow_count"]} == {0.0}
    assert [s for s, _ in scalars["epoch_loss_scale"]] == [0, 1]


def test_overflow_shows_in_scalars(tmp_path):
    with tfmp.policy_scope("mixed_float16", loss_scale_options={"initial_scale": 2.0**40, "max_scale": 2.0**40}):
        model = tiny_model()
        model.compile(optimizer="sgd", loss="mse")
        x, y = data(16)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[tfmp.LossScaleMonitor(tmp_path, update_freq="batch")])
    scalars = read_scalars(tmp_path)
    # 2**40 overflows float16 gradients: the first two steps are skipped and halve the scale.
    assert scalars["batch_overflow_count"] == [(1, 1.0), (2, 2.0)]
    assert scalars["batch_loss_scale"] == [(1, 2.0**39), (2, 2.0**38)]


def test_update_freq_every_n_and_steps_per_execution(tmp_path):
    model = tiny_model()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x, y = data()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0,
              callbacks=[tfmp.LossScaleMonitor(tmp_path, update_freq=4)])
    scalars = read_scalars(tmp_path)
    assert [s for s, _ in scalars["batch_loss_scale"]] == [4, 8]


@pytest.mark.parametrize("bad", ["step", 0, -3, 1.5, True])
def test_bad_update_freq(bad):
    with pytest.raises(ValueError, match=r"Invalid `update_freq` argument.*'epoch', 'batch' or a positive int"):
        tfmp.LossScaleMonitor("logs", update_freq=bad)
