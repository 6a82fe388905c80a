"""The example scripts: real digits runs, the tensorflow-datasets paths on mock data, --help."""

import pathlib
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from _events import read_run
from _machines import REMAPPER_TRAP

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import custom_training_loop  # noqa: E402
import export_model  # noqa: E402
import example_utils  # noqa: E402
import tfds_preflight  # noqa: E402
import tfmp  # noqa: E402
from tfmp._src.keras_hooks import runtime_options  # noqa: E402
from tfmp._src.policy.hardware import injected_facts  # noqa: E402
import train_digits  # noqa: E402
import train_image_classifier  # noqa: E402
import train_multi_worker  # noqa: E402
import train_text_transformer  # noqa: E402

# What "auto" picks on this machine: float32 on a CPU without bfloat16 hardware,
# where tfmp leaves the optimizer alone and the monitor writes no overflow counts.
AUTO = tfmp.recommend_policy().policy
SKIP_FP16_WARNING = pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")


@pytest.fixture
def hosts_answer(monkeypatch):
    """`tfds.testing.mock_data` serves the data: the preflight's network check passes."""
    monkeypatch.setattr(tfds_preflight, "host_reachable", lambda url: True)


def the_run(log_dir):
    """The one run folder a script made below its --log-dir (each run gets a new one)."""
    runs = sorted(log_dir.iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def assert_monitor_logged(run, policy):
    """The monitor's loss-scale tags, and overflow counts exactly when tfmp's optimizer is there."""
    assert {"precision/batch_loss_scale", "precision/epoch_loss_scale"} <= set(run)
    counts = {"precision/batch_overflow_count", "precision/epoch_overflow_count"}
    if policy == "float32":
        assert not counts & set(run)
    else:
        assert counts <= set(run)


def test_main_job_trains_digits_with_auto_policy(tmp_path, capsys):
    with warnings.catch_warnings():
        # Its loss-scale options are for the float16 run; it says loss_scaling itself.
        warnings.simplefilter("error", tfmp.LossScaleWarning)
        accuracy = train_digits.main(["--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert accuracy >= 0.9
    assert "tfmp policy:" in out
    assert f"tensorboard --logdir {tmp_path} (this run: {the_run(tmp_path)})" in out
    assert f"tfmp policy: {AUTO} on " in out
    # What tfmp did to the model, said once at compile (its tfmp.Attachment), before training.
    forced = ("no layer forced to float32" if AUTO == "float32"
              else "1 layer forced to float32: softmax (model output)")
    scaling = "dynamic loss scale" if AUTO == "mixed_float16" else "no loss scaling (fixed scale 1.0)"
    line = (f"tfmp: model 'digits_classifier' compiled under {AUTO}; {forced}; optimizer "
            f"tfmp.LossScaleOptimizer(Adam): {scaling}, guard='auto', fused updates on\n")
    assert out.count("tfmp: model ") == 1 and line in out
    assert out.index("tfmp policy:") < out.index(line) < out.index("Epoch 1/15")
    run = read_run(the_run(tmp_path))
    # The main job passes loss-scale options, so even a float32 model gets tfmp's
    # optimizer: non-finite steps are skipped and counted at a fixed scale of 1.
    assert_monitor_logged(run, "mixed_bfloat16")
    steps = len(run["precision/batch_loss_scale"])
    assert steps == 15 * 23  # 15 epochs of ceil(1437 / 64) batches
    if AUTO != "mixed_float16":  # a GPU of compute capability 7.x would scale
        assert {v for _, v in run["precision/batch_loss_scale"]} == {1.0}  # bfloat16 or float32
        assert {v for _, v in run["precision/batch_overflow_count"]} == {0.0}
        # The story beside the flat scale: the note, the loss, the gradients, the updates.
        [(_, note)] = run["loss_scale_note"]
        assert note.startswith("The loss scale stays 1 (a flat chart): ")
    for tag in ("metrics/batch_loss", "metrics/batch_accuracy"):
        assert len(run[tag]) == steps, tag
    for tag in ("optimizer/grad_norm", "optimizer/update_ratio", "precision/bfloat16_relative_precision"):  # every 5 steps
        assert [step for step, _ in run[tag]] == list(range(5, steps + 1, 5)), tag
    assert len(run["metrics/epoch_loss"]) == len(run["metrics/epoch_accuracy"]) == 15
    assert run["metrics/epoch_accuracy"][-1][1] >= 0.9
    assert run["metrics/epoch_loss"][-1][1] < run["metrics/epoch_loss"][0][1]


@SKIP_FP16_WARNING
def test_main_job_digits_mixed_float16_scale_backs_off_and_grows(tmp_path):
    """The README's float16 run, shortened to 2 epochs (46 steps): the scale moves both ways."""
    train_digits.main(["--policy", "mixed_float16", "--filters", "4", "--units", "16",
                       "--epochs", "2", "--log-dir", str(tmp_path)])
    run = read_run(the_run(tmp_path))
    scales = np.array([v for _, v in run["precision/batch_loss_scale"]])
    assert len(scales) == 46
    steps_down = np.flatnonzero(np.diff(np.concatenate([[2.0**24], scales])) < 0)
    steps_up = np.flatnonzero(np.diff(scales) > 0)
    assert len(steps_down) >= 1 and len(steps_up) >= 1
    assert steps_down[0] == 0  # 2**24 overflows at the first step
    overflows = run["precision/batch_overflow_count"][-1][1]
    assert overflows == len(run["overflow_events"]) >= 1
    assert len(run["metrics/batch_loss"]) == len(run["metrics/batch_accuracy"]) == 46
    assert [step for step, _ in run["metrics/epoch_accuracy"]] == [0, 1]
    assert "loss_scale_note" not in run  # the scale moves: nothing to explain


def test_a_second_run_logs_to_its_own_folder(tmp_path, capsys):
    def run(steps):
        train_digits.main(["--epochs", "1", "--steps", str(steps), "--policy", "float32",
                           "--log-dir", str(tmp_path)])

    run(3)
    first = the_run(tmp_path)
    run(2)  # same --log-dir, fewer steps: its events must not mix with the first run's
    second = sorted(set(tmp_path.iterdir()) - {first})
    assert len(second) == 1 and second[0].name > first.name
    assert [step for step, _ in read_run(first)["precision/batch_loss_scale"]] == [1, 2, 3]
    assert [step for step, _ in read_run(second[0])["precision/batch_loss_scale"]] == [1, 2]
    assert f"(this run: {second[0]})" in capsys.readouterr().out


def test_new_run_dir_never_reuses_a_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(example_utils.time, "strftime", lambda fmt: "20260102-030405")
    made = [example_utils.new_run_dir(tmp_path / "logs") for _ in range(3)]
    assert made == [str(tmp_path / "logs" / name)
                    for name in ("20260102-030405", "20260102-030405-2", "20260102-030405-3")]
    assert all(not list(pathlib.Path(path).iterdir()) for path in made)


@pytest.mark.usefixtures("hosts_answer")
@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_tfds_path_with_mock_data(tmp_path, dataset):
    with tfds.testing.mock_data(num_examples=64):
        accuracy = train_digits.main(
            ["--dataset", dataset, "--epochs", "1", "--steps", "2", "--batch-size", "16",
             "--log-dir", str(tmp_path), "--policy", "float32"]
        )
    assert 0.0 <= accuracy <= 1.0
    run = read_run(the_run(tmp_path))  # the monitor logged each of the 2 batches and the epoch
    assert [step for step, _ in run["precision/batch_loss_scale"]] == [1, 2]
    assert run["precision/epoch_loss_scale"] == [(0, 1.0)]


def test_policy_choices_are_tfmps():
    import example_args
    from tfmp._src.policy.policy import POLICY_CHOICES

    assert example_args.POLICY_CHOICES == POLICY_CHOICES


def test_unknown_dataset_message():
    with pytest.raises(ValueError, match=r"Received: dataset='svhn'.*--dataset digits"):
        train_digits.make_datasets("svhn", 32)


# The other example scripts and the shared helpers ------------------------------------

SCRIPTS = {
    train_digits: ("--dataset", "--data-dir", "--policy", "--epochs", "--steps", "--log-dir",
                   "--filters", "--units"),
    train_image_classifier: ("--dataset", "cifar10", "mnist", "--data-dir", "--policy", "--epochs",
                             "--steps", "--batch-size", "--log-dir", "--seed"),
    train_text_transformer: ("imdb_reviews", "--data-dir", "--policy", "--epochs", "--steps",
                             "--max-tokens", "--sequence-length", "--log-dir"),
    export_model: ("--policy", "--epochs", "--steps", "--batch-size", "--log-dir", "--seed",
                   "--out-dir"),
    custom_training_loop: ("--policy", "--epochs", "--steps", "--learning-rate",
                           "--clipnorm", "--accumulation-steps", "--log-dir"),
    train_multi_worker: ("TF_CONFIG", "--workers", "--cluster-timeout", "--policy", "--epochs",
                         "--steps", "--batch-size", "--log-dir", "--seed"),
}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda module: module.__name__)
def test_every_script_help_explains_its_options(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in SCRIPTS[script]:
        assert word in out
    assert "default" in out


def test_a_script_runs_from_the_command_line():
    """As users run them: `python examples/<script>.py`, helpers found next to it."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_training_loop.py"), "--help"],
        capture_output=True, text=True, check=True)
    assert result.stdout.startswith("usage: custom_training_loop.py")


def test_multi_worker_script_starts_two_local_workers_and_only_the_chief_logs(tmp_path, capsys, monkeypatch):
    """As README shows it: no TF_CONFIG, so the script starts its own two workers."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    accuracy = train_multi_worker.main(["--epochs", "2", "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert accuracy >= 0.9
    assert "Started 2 workers on 127.0.0.1:" in out
    assert f"tfmp policy: {AUTO}; 2 workers; " in out
    assert f"{train_multi_worker.ACCURACY_LINE} ({AUTO}): {accuracy:.4f}" in out
    run = the_run(tmp_path)  # the chief made the one run folder, and wrote its one event file
    assert len(list((run / "train").iterdir())) == 1
    if AUTO != "float32":  # tfmp's optimizer: the monitor logs its scale after each epoch
        assert [step for step, _ in read_run(run)["precision/epoch_loss_scale"]] == [0, 1]


@pytest.mark.usefixtures("hosts_answer")
@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_image_classifier_with_mock_data(tmp_path, capsys, dataset):
    with tfds.testing.mock_data(num_examples=32):
        accuracy = train_image_classifier.main(
            ["--dataset", dataset, "--epochs", "1", "--steps", "2", "--batch-size", "8",
             "--policy", "mixed_bfloat16", "--log-dir", str(tmp_path)])
    assert 0.0 <= accuracy <= 1.0
    assert "Test accuracy (" in capsys.readouterr().out
    assert_monitor_logged(read_run(the_run(tmp_path)), "mixed_bfloat16")


def test_cnn_forces_only_the_sensitive_layers_to_float32():
    with tfmp.policy_scope("mixed_bfloat16"):
        model = train_image_classifier.build_cnn((32, 32, 3))
        model.compile("adam", "sparse_categorical_crossentropy")
    dtypes = {(layer.__class__.__name__, layer.compute_dtype, layer.output.dtype)
              for layer in model.layers[1:]}
    # BatchNormalization computes its statistics in float32 inside Keras: left bfloat16.
    assert {d for d in dtypes if d[0] in ("Conv2D", "BatchNormalization", "Dense")} == {
        ("Conv2D", "bfloat16", "bfloat16"), ("BatchNormalization", "bfloat16", "bfloat16"),
        ("Dense", "bfloat16", "bfloat16")}
    assert ("Softmax", "float32", "float32") in dtypes  # the output layer
    assert [d[1] for d in dtypes].count("float32") == 1
    assert model.outputs[0].dtype == "float32"


@pytest.mark.usefixtures("hosts_answer")
def test_text_transformer_with_mock_imdb(tmp_path):
    with tfds.testing.mock_data(num_examples=32):
        accuracy = train_text_transformer.main(
            ["--epochs", "1", "--steps", "2", "--batch-size", "8", "--max-tokens", "64",
             "--sequence-length", "16", "--policy", "mixed_bfloat16", "--log-dir", str(tmp_path)])
    assert 0.0 <= accuracy <= 1.0
    assert_monitor_logged(read_run(the_run(tmp_path)), "mixed_bfloat16")


@SKIP_FP16_WARNING
def test_text_transformer_mixed_float16_keeps_attention_softmax_in_float32():
    with tfmp.policy_scope("mixed_float16"):
        model = train_text_transformer.build_transformer((16,), vocabulary_size=64)
        model.compile("adam", "sparse_categorical_crossentropy")
        probabilities = model(np.ones((2, 16), "int64"), training=False)
    attention = next(layer for layer in model.layers
                     if isinstance(layer, keras.layers.MultiHeadAttention))
    assert attention.compute_dtype == "float16"
    assert attention._softmax.compute_dtype == "float32"
    assert probabilities.dtype == "float32"
    np.testing.assert_allclose(np.sum(probabilities, axis=-1), 1.0, rtol=1e-5)


@SKIP_FP16_WARNING
def test_custom_training_loop_script(tmp_path, capsys):
    accuracy = custom_training_loop.main(
        ["--policy", "mixed_float16", "--epochs", "1", "--steps", "6",
         "--accumulation-steps", "2", "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert 0.0 <= accuracy <= 1.0
    assert "6 steps" in out and "loss scale" in out
    steps, scales = example_utils.read_scalars(str(the_run(tmp_path)), "precision/batch_loss_scale")
    assert list(steps) == [1, 2, 3, 4, 5, 6]
    assert scales[0] == 2.0**15  # mixed_float16: Keras's initial scale, dynamic scaling on


REWRITER = tf.compat.v1.ConfigProto().graph_options.rewrite_options
OFF, DEFAULT = type(REWRITER).OFF, REWRITER.remapping


def remapping_at_each_step(monkeypatch):
    """Grappler's remapper setting in force at each call of the example loop's step."""
    seen = []
    make = custom_training_loop.make_train_step

    def recording(*args, **kwargs):
        step = make(*args, **kwargs)

        def call(*step_args):
            seen.append(runtime_options.function_call_config_now().graph_options.rewrite_options.remapping)
            return step(*step_args)

        return call

    monkeypatch.setattr(custom_training_loop, "make_train_step", recording)
    return seen


@SKIP_FP16_WARNING
@pytest.mark.parametrize("machine", sorted(REMAPPER_TRAP))
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_custom_loop_equals_fit_with_clipping_and_accumulation(policy, machine, monkeypatch):
    """Same weights, batches and optimizer: the loop and model.fit end identical.

    On each CPU's branch: on a Sapphire Rapids a mixed_float16 model's fit runs
    without Grappler's remapper, and the example's loop takes the same graph
    through `tfmp.step_scope`.
    """
    (x, y), _ = train_digits.load_digits_arrays()
    data = tf.data.Dataset.from_tensor_slices((x[:192], y[:192])).batch(32)
    weights, states = [], []
    remapping = remapping_at_each_step(monkeypatch)
    with injected_facts(REMAPPER_TRAP[machine]), tfmp.policy_scope(policy):
        for use_fit in (False, True):
            keras.utils.set_random_seed(0)
            model = train_digits.build_model((8, 8, 1))
            optimizer = custom_training_loop.make_optimizer(
                0.05, clipnorm=1.0, accumulation_steps=2, initial_scale=2.0**20,
                dynamic_growth_steps=2)
            loss_fn = keras.losses.SparseCategoricalCrossentropy()
            model.compile(optimizer=optimizer, loss=loss_fn)
            if use_fit:
                model.fit(data, epochs=2, verbose=0, shuffle=False)
            else:
                custom_training_loop.train(model, optimizer, loss_fn, data, epochs=2)
            weights.append(model.get_weights())
            states.append((optimizer.loss_scale, int(optimizer.overflow_count.numpy()),
                           int(optimizer.inner_optimizer.iterations.numpy())))
    assert states[0] == states[1]
    trap = policy == "mixed_float16" and machine == "sapphire_rapids"
    assert (tfmp.attachment(model).remapper != "on") is trap
    assert set(remapping) == {OFF if trap else DEFAULT}  # the loop's steps ran fit's graph options
    if policy == "mixed_float16":
        assert states[0][1] > 0  # 2**20 overflowed float16 at first: steps were skipped
    assert len(weights[0]) == len(weights[1])
    for loop_weight, fit_weight in zip(*weights):  # noqa: B905 (lengths checked; Python 3.9)
        np.testing.assert_array_equal(loop_weight, fit_weight)


def test_read_scalars_and_overflow_steps(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path / "train"))
    with writer.as_default():
        for step, count in enumerate([0, 1, 1, 3, 3], start=1):
            tf.summary.scalar("precision/batch_overflow_count", count, step=step)
    writer.close()
    steps, counts = example_utils.read_scalars(str(tmp_path), "precision/batch_overflow_count")
    assert list(steps) == [1, 2, 3, 4, 5] and list(counts) == [0, 1, 1, 3, 3]
    assert list(example_utils.overflow_steps(steps, counts)) == [2, 4]
    assert example_utils.read_scalars(str(tmp_path), "missing")[0].size == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policy", "fp16"], "invalid choice: 'fp16'"),
        (["--epochs", "0"], "expected a whole number >= 1, received '0'"),
        (["--batch-size", "x"], "expected a whole number >= 1, received 'x'"),
    ],
)
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        train_digits.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@SKIP_FP16_WARNING
def test_export_script_trains_mixed_and_ships_float32(tmp_path, capsys):
    reports = export_model.main(
        ["--policy", "mixed_bfloat16", "--epochs", "1", "--steps", "3",
         "--out-dir", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert [(r.format, r.weights) for r in reports] == [
        ("tf_saved_model", "float32"), ("tflite", "float32"), ("tflite", "float16")]
    for report in reports:
        assert report.output_shapes == ((64, 10),)
        # bfloat16-trained against float32 artifacts: 8 roundings of 2**-9 (see
        # tests/test_deployment.py), plus 2**-8 for float16 weights.
        assert 0 < report.max_rel_diff <= 2.0**-6 + (2.0**-8 if report.weights == "float16" else 0)
        assert str(report) in out
    assert reports[2].size_bytes < reports[1].size_bytes
    assert (tmp_path / "out" / "digits.tflite").stat().st_size == reports[1].size_bytes
    assert keras.models.load_model(tmp_path / "out" / "digits_float32.keras",
                                   compile=False).compute_dtype == "float32"
