"""Keras layers whose 16-bit numerics are wrong, each forced to float32 and checked against a closed form."""

import keras
import numpy as np
import pytest

import tfmp

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
