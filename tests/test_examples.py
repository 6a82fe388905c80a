"""The main job: a real digits run, its TensorBoard logs, and the tensorflow-datasets path."""

import glob
import pathlib
import subprocess
import sys

import pytest
import tensorflow_datasets as tfds
from _events import read_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_digits  # noqa: E402


def test_main_job_trains_digits_with_auto_policy(tmp_path, capsys):
    accuracy = train_digits.main(["--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert accuracy >= 0.9
    assert "tfmp policy:" in out
    assert f"tensorboard --logdir {tmp_path}" in out
    run = read_run(tmp_path)
    assert {"batch_loss_scale", "batch_overflow_count", "epoch_loss_scale",
            "epoch_overflow_count"} <= set(run)
    assert {v for _, v in run["batch_loss_scale"]} == {1.0}  # bfloat16: no scaling
    assert {v for _, v in run["batch_overflow_count"]} == {0.0}


@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_tfds_path_with_mock_data(tmp_path, dataset):
    with tfds.testing.mock_data(num_examples=64):
        accuracy = train_digits.main(
            ["--dataset", dataset, "--epochs", "1", "--steps", "2", "--batch-size", "16",
             "--log-dir", str(tmp_path), "--policy", "float32"]
        )
    assert 0.0 <= accuracy <= 1.0
    assert glob.glob(f"{tmp_path}/train/events.out.tfevents.*")


def test_unknown_dataset_message():
    with pytest.raises(ValueError, match=r"Received: dataset='svhn'.*--dataset digits"):
        train_digits.make_datasets("svhn", 32)


def test_help_explains_options():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_digits.py"), "--help"],
                            capture_output=True, text=True, check=True)
    for option in ("--dataset", "--policy", "--epochs", "--steps", "--log-dir"):
        assert option in result.stdout
