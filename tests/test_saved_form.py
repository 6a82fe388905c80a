"""No lock-in: a `.keras` file saved under tfmp opens in plain Keras, and under tfmp with everything back.

The plain-Keras side runs in a process of its own that cannot import tfmp
(tests/_plain_keras_load.py behind `_subproc.without_module`), so nothing tfmp
registered with Keras can help it.
"""

import json
import pathlib
import warnings
import zipfile

import keras
import numpy as np
import pytest
from _machines import A100, ZEN4

import _subproc
import tfmp
from tfmp._src.keras_hooks import versions
from tfmp._src.loss_scale import saved_form
from tfmp._src.policy.hardware import injected_facts

DATA = pathlib.Path(__file__).parent / "data"
#: Settings that differ from every default, so that each one is seen to come back.
SETTINGS = {"initial_scale": 2.0**12, "dynamic_growth_steps": 3, "min_scale": 4.0, "max_scale": 2.0**20,
            "hysteresis": 2, "max_consecutive_overflows": 40, "on_stuck": "warn", "guard": "gradients"}


@pytest.fixture(autouse=True)
def always_disable():
    yield
    tfmp.disable()


def _trained(policy, options=None):
    """A small model compiled and fitted under tfmp (one batch of the 4 holds inf), and its optimizer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 slower than float32 here; the skipped step
        tfmp.enable(policy, loss_scale_options=options)
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Softmax(), keras.layers.Dense(2)])
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        x = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")
        x[5, 1] = np.inf
        model.fit(x, np.ones((16, 2), "float32"), batch_size=4, epochs=2, verbose=0, shuffle=False)
    return model, model.optimizer


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_file_saved_under_tfmp_opens_in_plain_keras_in_a_process_without_tfmp(policy, tmp_path):
    model, optimizer = _trained(policy)
    assert int(optimizer.overflow_count.numpy()) == 2  # the inf batch of each epoch was skipped
    path = tmp_path / "model.keras"
    model.save(path)

    found = _subproc.plain_keras_load(path, tmp_path)

    assert found["tfmp_imported"] is False
    assert found["optimizer"] == "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer"
    assert found["inner"] == "Adam"
    assert not [w for w in found["warnings"] if "Skipping variable loading" in w], found["warnings"]
    # The float32 outputs and the forced Softmax stay float32: they are the layers' own policies.
    assert found["policies"] == [policy, "float32", "float32"]
    for saved, loaded in zip(model.get_weights(), found["weights"], strict=True):
        np.testing.assert_array_equal(saved, np.asarray(loaded, saved.dtype))
    # Adam's iterations and slots come back as they were (the skipped steps did not count).
    assert found["inner_iterations"] == int(optimizer.inner_optimizer.iterations.numpy()) == 6
    for saved, loaded in zip(optimizer.inner_optimizer.variables, found["inner_variables"], strict=True):
        np.testing.assert_array_equal(saved.numpy(), np.asarray(loaded, saved.numpy().dtype))
    assert found["scale"] == optimizer.loss_scale
    if policy == "mixed_float16":
        assert (found["initial_scale"], found["dynamic_growth_steps"]) == (2.0**15, 2000)
    else:  # a fixed scale of 1.0, as tfmp trained it
        assert (found["scale"], found["initial_scale"]) == (1.0, 1.0)
        assert found["dynamic_growth_steps"] == saved_form.FIXED_SCALE_GROWTH_STEPS
        assert found["scale_after_one_step"] == 1.0
    assert np.isfinite(found["loss_after_one_step"])


def test_the_file_opens_under_tfmp_with_every_setting_and_counter_back(tmp_path):
    model, optimizer = _trained("mixed_float16", SETTINGS)
    path = tmp_path / "model.keras"
    model.save(path)
    counters = {v.name: v.numpy() for v in optimizer.counter_variables()}
    assert counters["overflow_count"] == 2 and counters["total_steps"] == 8
    tfmp.disable()

    loaded = keras.models.load_model(path)

    restored = loaded.optimizer
    assert type(restored) is tfmp.LossScaleOptimizer
    config = restored.get_config()
    assert {key: config[key] for key in SETTINGS} == SETTINGS
    assert restored.loss_scaling is True
    assert restored.loss_scale == optimizer.loss_scale
    assert {v.name: v.numpy().tolist() for v in restored.counter_variables()} == {
        name: value.tolist() for name, value in counters.items()}
    assert int(restored.step_counter.numpy()) == int(optimizer.step_counter.numpy())


def test_a_bfloat16_file_keeps_its_fixed_scale_and_guard_under_tfmp(tmp_path):
    model, optimizer = _trained("mixed_bfloat16", {"guard": "values"})
    model.save(tmp_path / "model.keras")
    tfmp.disable()
    restored = keras.models.load_model(tmp_path / "model.keras").optimizer
    assert (restored.loss_scaling, restored.guard, restored.loss_scale) == (False, "values", 1.0)
    assert restored.get_config()["initial_scale"] == optimizer.get_config()["initial_scale"] == 2.0**15
    assert int(restored.overflow_count.numpy()) == 2


def test_weights_files_carry_the_counters_both_ways(tmp_path):
    model, optimizer = _trained("mixed_float16")
    model.save_weights(tmp_path / "model.weights.h5")
    expected = [v.numpy().tolist() for v in optimizer.counter_variables()]
    scale = optimizer.loss_scale
    assert scale == 2.0**13  # halved at each of the 2 skipped steps
    for variable in optimizer.counter_variables():
        variable.assign(np.zeros(variable.shape, variable.dtype))
    optimizer.dynamic_scale.assign(1.0)
    model.load_weights(tmp_path / "model.weights.h5")
    assert [v.numpy().tolist() for v in optimizer.counter_variables()] == expected
    assert optimizer.loss_scale == scale


def test_a_file_of_an_earlier_tfmp_still_opens_with_its_counters():
    """tests/data/tfmp_9fa527f_*: saved by tfmp at 9fa527f (every variable in one group, tfmp's class name)."""
    saved = json.loads((DATA / "tfmp_9fa527f_mixed_float16.json").read_text())
    if versions.keras_at_least(saved["keras_version"]) is False:
        pytest.skip(f"Keras {keras.__version__} cannot read layers Keras {saved['keras_version']} saved "
                    "(Dense's quantization_config)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "Skipping variable loading"
        model = keras.models.load_model(DATA / "tfmp_9fa527f_mixed_float16.keras")
    optimizer = model.optimizer
    assert type(optimizer) is tfmp.LossScaleOptimizer
    assert (optimizer.hysteresis, optimizer.min_scale, optimizer.max_consecutive_overflows) == (
        saved["hysteresis"], saved["min_scale"], saved["max_consecutive_overflows"])
    assert optimizer.loss_scale == saved["loss_scale"]
    assert int(optimizer.overflow_count.numpy()) == saved["overflow_count"]
    assert int(optimizer.total_steps.numpy()) == saved["total_steps"]
    assert int(optimizer.last_overflow_step.numpy()) == saved["last_overflow_step"]
    assert int(optimizer.inner_optimizer.iterations.numpy()) == saved["iterations"]
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), np.float32(saved["kernel0"]))


def test_a_file_plain_keras_wrote_keeps_keras_optimizer_where_tfmp_is_imported(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype="float32")])
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    model.fit(np.ones((4, 4)), np.ones((4, 2)), verbose=0)
    model.save(tmp_path / "plain.keras")
    loaded = keras.models.load_model(tmp_path / "plain.keras")
    assert type(loaded.optimizer) is keras.optimizers.LossScaleOptimizer


def _saved_optimizer_entry(path):
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("config.json"))["compile_config"]["optimizer"]


def test_every_model_with_tfmps_optimizer_saves_keras_form(tmp_path):
    """Compiled by hand without enable, loaded without enable and saved again, detached: each in Keras's form."""
    keras.config.set_dtype_policy("mixed_float16")  # restored by the conftest fixture
    by_hand = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype="float32")])
    by_hand.compile(tfmp.LossScaleOptimizer(keras.optimizers.SGD(), hysteresis=2), "mse")
    by_hand.fit(np.ones((4, 4)), np.ones((4, 2)), verbose=0)
    by_hand.save(tmp_path / "by_hand.keras")
    assert _saved_optimizer_entry(tmp_path / "by_hand.keras")["registered_name"] == saved_form.KERAS_NAME

    loaded = keras.models.load_model(tmp_path / "by_hand.keras")  # tfmp imported, not enabled
    assert type(loaded.optimizer) is tfmp.LossScaleOptimizer and loaded.optimizer.hysteresis == 2
    loaded.save(tmp_path / "again.keras")
    entry = _saved_optimizer_entry(tmp_path / "again.keras")
    assert (entry["module"], entry["registered_name"]) == ("keras.optimizers", saved_form.KERAS_NAME)

    model, _ = _trained("mixed_float16")
    tfmp.detach(model)
    model.save(tmp_path / "detached.keras")
    assert _saved_optimizer_entry(tmp_path / "detached.keras")["registered_name"] == saved_form.KERAS_NAME
    tfmp.disable()
    assert int(keras.models.load_model(tmp_path / "detached.keras").optimizer.overflow_count.numpy()) == 2


def test_an_attached_model_saves_keras_form_by_its_own_hook_and_once_detached_by_the_class_hook(tmp_path):
    from _collect import collect_everything

    from tfmp._src.keras_hooks import surfaces, trainer
    from tfmp._src.loss_scale import loops

    collect_everything()
    model, optimizer = _trained("mixed_float16")
    tfmp.disable()
    assert trainer.subscribed(model, "get_compile_config", "saved_form")  # the model's own
    if all(other in loops._served for other in loops._live):  # no other test's optimizer needs the class hook
        assert "saved_form" not in {hook.owner for hook in surfaces.process_wide()}
    model.save(tmp_path / "attached.keras")
    assert _saved_optimizer_entry(tmp_path / "attached.keras")["registered_name"] == saved_form.KERAS_NAME
    tfmp.detach(model)
    assert not trainer.subscribed(model, "get_compile_config", "saved_form")
    assert "saved_form" in {hook.owner for hook in surfaces.process_wide()}  # while the kept optimizer lives
    model.save(tmp_path / "detached.keras")
    assert _saved_optimizer_entry(tmp_path / "detached.keras")["registered_name"] == saved_form.KERAS_NAME


def test_keras_form_leaves_other_entries_and_its_argument_alone():
    adam = keras.saving.serialize_keras_object(keras.optimizers.Adam())
    assert saved_form.keras_form(adam) is adam
    ours = keras.saving.serialize_keras_object(tfmp.LossScaleOptimizer(keras.optimizers.SGD(), hysteresis=3))
    before = json.dumps(ours, sort_keys=True)
    converted = saved_form.keras_form(ours)
    assert json.dumps(ours, sort_keys=True) == before
    assert (converted["module"], converted["class_name"], converted["registered_name"]) == (
        "keras.optimizers", "LossScaleOptimizer", "LossScaleOptimizer")
    assert set(converted["config"]) == {"name", "inner_optimizer", "initial_scale", "dynamic_growth_steps"}
    assert converted["config"]["inner_optimizer"][saved_form.SETTINGS_KEY]["hysteresis"] == 3
    assert saved_form.from_keras_form(converted["config"])["hysteresis"] == 3


def test_a_model_saved_under_another_policy_is_said_and_its_attachment_names_that_policy(tmp_path):
    model, _ = _trained("mixed_float16")
    path = tmp_path / "float16.keras"
    model.save(path)
    tfmp.disable()
    tfmp.enable("mixed_bfloat16")
    with pytest.warns(UserWarning, match=r"(?s)was saved under 'mixed_float16' and trains so, not under this "
                      r"session's 'mixed_bfloat16'.*copy the weights \(set_weights\)"):
        loaded = keras.models.load_model(path)
    assert tfmp.attachment(loaded).policy == "mixed_float16"
    assert tfmp.attachment(loaded).optimizer == (
        "tfmp.LossScaleOptimizer(Adam): dynamic loss scale, guard='auto', fused updates on")
    assert {layer.compute_dtype for layer in loaded.layers} == {"float16", "float32"}  # float32: the outputs
    tfmp.disable()
    tfmp.enable("mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the same policy: nothing to say
        again = keras.models.load_model(path)
    assert tfmp.attachment(again).policy == "mixed_float16"


def test_reading_the_keras_form_leaves_the_config_it_reads_unchanged():
    """`saved_form.from_keras_form` copies the inner optimizer's entry before taking tfmp's
    settings out of it: the config it is handed keeps them, and a second read of the same
    config gives the same arguments."""
    import copy

    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0, guard="gradients")
    config = saved_form.keras_form(keras.saving.serialize_keras_object(optimizer))["config"]
    kept = copy.deepcopy(config)
    first = saved_form.from_keras_form(config)
    assert config == kept
    assert saved_form.from_keras_form(config) == first
    assert first["initial_scale"] == 8.0 and first["guard"] == "gradients"
    assert saved_form.SETTINGS_KEY not in first["inner_optimizer"]


@pytest.mark.parametrize("facts, slow", [(ZEN4, True), (A100, False)], ids=["cpu", "gpu"])
def test_a_float16_model_loaded_where_float16_is_slow_says_so(tmp_path, facts, slow):
    model, _ = _trained("mixed_float16")
    path = tmp_path / "float16.keras"
    model.save(path)
    tfmp.disable()
    with injected_facts(facts), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tfmp.enable("mixed_bfloat16")
        keras.models.load_model(path)
    [said] = [str(w.message) for w in caught if "was saved under 'mixed_float16'" in str(w.message)]
    assert ("'mixed_float16' is slower than float32 on this machine" in said) is slow
