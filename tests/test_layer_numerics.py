"""Keras layers whose 16-bit numerics are wrong, each forced to float32 and checked against a closed form."""

import contextlib
import json
import warnings

import _subproc
import keras
import numpy as np
import pytest

import tfmp
from tfmp._src.float32 import registry

RNG = np.random.default_rng(0)
A = RNG.normal(size=(4, 64)).astype("float32") * 300.0  # squared norms ~ 6e6, past float16's 65504
B = A * 0.9 + RNG.normal(size=(4, 64)).astype("float32") * 30.0


def _cosines(a, b):
    a, b = a.astype("float64"), b.astype("float64")
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_normalized_dot_computes_cosines_in_float32(policy):
    dtype = keras.DTypePolicy(policy).compute_dtype
    # The closed form, rounded once to the dtype the layer hands on to the next one.
    expected = np.asarray(keras.ops.cast(_cosines(A, B), dtype)).astype("float64")
    plain = keras.layers.Dot(axes=1, normalize=True, dtype=policy)([A, B]).numpy().ravel().astype("float64")
    assert not np.array_equal(plain, expected)  # plain Keras: 0.0 in float16, 1.0 for 0.9954 in bfloat16
    with tfmp.policy_scope(policy):
        a, b = keras.Input((64,)), keras.Input((64,))
        cosine = keras.layers.Dot(axes=1, normalize=True, name="cosine")([a, b])
        model = keras.Model([a, b], keras.layers.Dense(1, name="out")(cosine))
        model.compile("sgd", "mse")
    assert tfmp.attachment(model).forced_float32["cosine"] == "cosine (Dot normalize=True)"
    computed = keras.ops.cast(model.get_layer("cosine")([A, B]), dtype)  # float32, rounded as handed on
    np.testing.assert_array_equal(np.asarray(computed, "float64").ravel(), expected)


def test_a_stft_spectrogram_builds_and_trains_under_bfloat16():
    with pytest.raises(TypeError, match="Invalid input type"):  # plain Keras under mixed_bfloat16
        keras.layers.STFTSpectrogram(frame_length=64, frame_step=32, dtype="mixed_bfloat16")(
            np.zeros((1, 512, 1), "float32"))
    signal = np.sin(np.linspace(0.0, 200.0, 2 * 512, dtype="float32")).reshape(2, 512, 1)
    with tfmp.policy_scope("mixed_bfloat16"):
        inputs = keras.Input((512, 1))
        spectrum = keras.layers.STFTSpectrogram(frame_length=64, frame_step=32, name="stft")(inputs)
        pooled = keras.layers.GlobalAveragePooling1D()(spectrum)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(pooled))
        model.compile("sgd", "mse")
        computed = np.asarray(model.get_layer("stft")(signal))
        history = model.fit(signal, np.ones((2, 1), "float32"), verbose=0)
    assert tfmp.attachment(model).forced_float32["stft"].startswith("known fix: call() accepts float16")
    reference = keras.layers.STFTSpectrogram(frame_length=64, frame_step=32)(signal)  # float32 throughout
    # Computed in float32 and handed on in the model's bfloat16: the float32 result rounded once.
    expected = np.asarray(keras.ops.cast(reference, "bfloat16")).astype("float32")
    np.testing.assert_array_equal(computed.astype("float32"), expected)
    assert np.isfinite(history.history["loss"]).all()


@contextlib.contextmanager
def _plain_keras(policy):
    """Plain Keras under `policy` (tfmp not enabled), the float32 policy back on exit."""
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy("float32")


def _without_dtype(config):
    """A layer config (JSON form) without its ``dtype`` entries, nested layers' too."""
    if isinstance(config, dict):
        return {k: _without_dtype(v) for k, v in config.items() if k != "dtype"}
    if isinstance(config, list):
        return [_without_dtype(v) for v in config]
    return config


SPECTRAL_X = RNG.normal(size=(512, 32)).astype("float32")
SPECTRAL_Y = (SPECTRAL_X @ RNG.normal(size=(32, 1))).astype("float32")


def _spectral_model():
    inputs = keras.Input((32,))
    hidden = keras.layers.SpectralNormalization(keras.layers.Dense(64), name="sn")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))


def _spectral_kernel(scope):
    """The wrapped kernel after 10 epochs of Adam(1e-4) (160 steps) under `scope`, and the model."""
    keras.utils.set_random_seed(1)
    with scope:
        model = _spectral_model()
        model.compile(keras.optimizers.Adam(1e-4), "mse")
        model.fit(SPECTRAL_X, SPECTRAL_Y, epochs=10, batch_size=32, verbose=0)
    return model.get_layer("sn").layer.kernel.numpy(), model


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_spectral_normalization_trains_like_float32(policy):
    reference, _ = _spectral_kernel(_plain_keras("float32"))
    plain, _ = _spectral_kernel(_plain_keras(policy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # float16 slower than float32 here
        fixed, model = _spectral_kernel(tfmp.policy_scope(policy))

    def off(kernel):
        return np.linalg.norm(kernel - reference) / np.linalg.norm(reference)

    # Plain Keras writes kernel / sigma computed in 16 bits back into the float32
    # kernel every step, so Adam's small steps are rounded away: 13.6% off
    # float32's kernel under bfloat16, 2.4% under float16 (Zen 4).
    assert off(plain) > 0.01, off(plain)
    assert off(fixed) < 1e-4, off(fixed)
    assert tfmp.attachment(model).forced_float32["sn"].startswith("known fix: the power iteration")
    assert model.get_layer("sn").compute_dtype == "float32"
    # handed on in the 16-bit dtype, as plain Keras does
    assert model.get_layer("sn").output.dtype == keras.DTypePolicy(policy).compute_dtype


def _rounded_once(reference, dtype):
    """`reference` rounded once to `dtype` (the dtype a forced layer hands on), as float64."""
    return np.asarray(keras.ops.cast(reference, dtype)).astype("float64")


@pytest.mark.parametrize("amplitude", [1.0, 0.01])
def test_a_mel_spectrogram_of_a_sine_is_float32_s_rounded_once_under_bfloat16(amplitude):
    rate = 16000
    signal = (amplitude * np.sin(2 * np.pi * 440.0 * np.arange(rate) / rate)).astype("float32")[None]
    reference = keras.layers.MelSpectrogram(sampling_rate=rate)(signal)  # float32 throughout, dB
    expected = _rounded_once(reference, "bfloat16")
    plain = np.asarray(keras.layers.MelSpectrogram(sampling_rate=rate, dtype="mixed_bfloat16")(signal), "float64")
    # Plain Keras autocasts the signal to bfloat16 before its float32 STFT: the rounding
    # noise fills the bins away from 440 Hz (10.5 dB off at amplitude 1, 13.2 dB at 0.01).
    assert np.abs(plain - expected).max() > 5.0
    with tfmp.policy_scope("mixed_bfloat16"):
        inputs = keras.Input((rate,))
        mel = keras.layers.MelSpectrogram(sampling_rate=rate, name="mel")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(mel))
        model.compile("sgd", "mse")
        computed = np.asarray(model.get_layer("mel")(signal), "float64")
    assert tfmp.attachment(model).forced_float32["mel"].startswith("known fix: its float32 STFT")
    np.testing.assert_array_equal(computed, expected)


def test_keras_hub_s_sine_position_encoding_matches_by_class_path_alone():
    path = "keras_hub.src.layers.modeling.sine_position_encoding.SinePositionEncoding"
    note = registry.note_for_path(path, registry.KNOWN_BROKEN)
    assert (note.package, note.keras_version) == ("keras-hub", "0.32")
    assert "positions >= 256 collide" in note.why
    assert registry.note_for_path(path.replace("keras_hub.", "my_models."), registry.KNOWN_BROKEN) is None
    assert registry.note_for_path(path + "V2", registry.KNOWN_BROKEN) is None


def test_keras_hub_s_sine_position_encoding_is_float32_s_rounded_once_under_bfloat16(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    tokens = np.zeros((1, 1024, 64), "float32")  # 1024 positions x 64 dims
    reference = np.asarray(keras_hub.layers.SinePositionEncoding()(tokens))  # float32 throughout
    expected = _rounded_once(reference, "bfloat16")
    plain = np.asarray(keras_hub.layers.SinePositionEncoding(dtype="mixed_bfloat16")(tokens), "float64")
    assert np.abs(plain - expected).max() > 1.0  # 1.99: bfloat16 positions >= 256 collide
    assert np.array_equal(plain[0, 300], plain[0, 301])
    with tfmp.policy_scope("mixed_bfloat16"):
        inputs = keras.Input((1024, 64))
        encoding = keras_hub.layers.SinePositionEncoding(name="position")(inputs)
        summed = keras.layers.Add(name="add")([inputs, encoding])
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(summed))
        model.compile("sgd", "mse")
        computed = np.asarray(model.get_layer("position")(tokens), "float64")
        report = tfmp.audit(model)
        history = model.fit(tokens, np.ones((1, 1024, 1), "float32"), verbose=0)
    np.testing.assert_array_equal(computed, expected)
    assert model.get_layer("position").output.dtype == "bfloat16"
    assert "known fix: positions and angles in the compute dtype" in str(report)
    assert np.isfinite(history.history["loss"]).all()
    model.save(tmp_path / "hub.keras")
    loaded = keras.saving.load_model(tmp_path / "hub.keras")  # tfmp disabled: plain Keras
    config = loaded.get_layer("position").get_config()
    assert config == model.get_layer("position").get_config()
    assert (config["max_wavelength"], config["dtype"]["config"]["name"]) == (10000, "float32")
    # alone, outside a model, the loaded layer hands back its float32 result
    np.testing.assert_array_equal(np.asarray(loaded.get_layer("position")(tokens)), reference)


def _mel_model():
    inputs = keras.Input((4096,))
    mel = keras.layers.MelSpectrogram(sampling_rate=8000, num_mel_bins=32, name="mel")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(mel))


@pytest.mark.parametrize("build, forced", [(_spectral_model, "sn"), (_mel_model, "mel")])
def test_a_saved_forced_layer_opens_and_trains_in_plain_keras_with_the_user_s_config(build, forced, tmp_path):
    with tfmp.policy_scope("mixed_bfloat16"):
        model = build()
        user = {layer.name: json.loads(json.dumps(layer.get_config())) for layer in model.layers}
        model.compile("sgd", "mse")
        x = np.ones((4,) + tuple(model.inputs[0].shape[1:]), "float32")
        model.fit(x, np.ones((4,) + tuple(model.outputs[0].shape[1:]), "float32"), verbose=0)
        report = str(tfmp.audit(model))
    cls = type(model.get_layer(forced))
    note = registry.note_for_path(f"{cls.__module__}.{cls.__qualname__}", registry.KNOWN_BROKEN)
    assert f"known fix: {note.why}" in report
    model.save(tmp_path / "model.keras")

    found = _subproc.plain_keras_load(tmp_path / "model.keras", tmp_path)

    assert found["tfmp_imported"] is False
    assert found["configs"][forced]["dtype"]["config"]["name"] == "float32"
    assert {name: _without_dtype(config) for name, config in found["configs"].items()} == \
        {name: _without_dtype(config) for name, config in user.items()}
    assert np.isfinite(found["loss_after_one_step"])
