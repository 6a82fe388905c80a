"""Public mixed-precision bug reports where plain Keras stops with a bare error.

One test per kind, each citing its report: plain Keras's failure first (so the
case stays a real one), then what tfmp says (the exact text it adds, Keras's own
text and exception type kept) or the warned fallback and its float32-equal result.
"""

import contextlib
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

import tfmp
from tfmp._src.errors import guide


@contextlib.contextmanager
def _tfmp(policy, **options):
    """`tfmp.policy_scope` without its 'slower than float32 here' warning (CPU without 16-bit units)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        scope = tfmp.policy_scope(policy, **options)
        scope.__enter__()
    try:
        yield
    finally:
        scope.__exit__(None, None, None)


def _raised(cls, build):
    with pytest.raises(cls) as caught:
        build()
    return caught.value


# keras.io VAE (Sampling layer) and the keras.io Switch Transformer (einsum experts)


class Sampling(layers.Layer):
    """The keras.io VAE's reparameterization: float32 noise added to 16-bit inputs."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean))
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def _vae_encoder_head(**sampling_kwargs):
    x = keras.Input((4,))
    return Sampling(name="sampling", **sampling_kwargs)([layers.Dense(2)(x), layers.Dense(2)(x)])


_KERAS_SAMPLING = ("Could not automatically infer the output shape / dtype of 'sampling' "
                   "(of type Sampling).")
_MUL_TEXT = "Input 'y' of 'Mul' Op has type float32 that does not match type bfloat16 of argument 'x'."


def _tfmp_text(path, cls):
    """tfmp's lines after the build error: the only fixes that act before compile (not keep_float32)."""
    return (
        f"tfmp: Layer '{path}' ({cls}) mixes bfloat16 and float32 tensors; its inputs are bfloat16.\n"
        "Its own code makes the float32 one: a cast to float32, tf.constant, tf.ones, tf.random.*, a raw TF op.\n"
        f"Fix: make it with tf.cast(t, x.dtype) or dtype=self.compute_dtype; or create {cls} with "
        f"dtype=\"float32\".\nGuide: " + guide("a-layer-mixes-16-bit-and-float32-tensors")
    )


def test_vae_sampling_build_error_names_the_layer_and_the_fix_keras_io_vae():
    """keras.io VAE: `Sampling` adds `keras.random.normal` float32 noise to its 16-bit
    inputs; building the Functional encoder fails under any mixed policy with Keras's
    "Could not automatically infer the output shape / dtype of 'sampling'" alone."""
    keras.config.set_dtype_policy("mixed_bfloat16")  # the fixture restores it
    plain = _raised(TypeError, _vae_encoder_head)
    keras.config.set_dtype_policy("float32")
    assert _KERAS_SAMPLING in str(plain) and _MUL_TEXT in str(plain) and "tfmp" not in str(plain)
    with _tfmp("mixed_bfloat16"):
        error = _raised(TypeError, _vae_encoder_head)  # same type as Keras's
        text = str(error)
        assert _KERAS_SAMPLING in text  # Keras's text kept, tfmp's after TensorFlow's
        assert f"{_MUL_TEXT}\n\n{_tfmp_text('sampling', 'Sampling')}" in text
        z = _vae_encoder_head(dtype="float32")  # the float32 remedy the text names builds
        assert z.dtype == "float32"


class Switch(layers.Layer):
    """The keras.io Switch Transformer's expert dispatch, reduced: float32 experts in `tf.einsum`."""

    def build(self, input_shape):
        self.experts = self.add_weight(shape=(3, input_shape[-1], 4), dtype="float32",
                                       autocast=False, name="experts")

    def call(self, x):
        return tf.einsum("bd,edf->bef", x, self.experts)


class Block(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense, self.switch = layers.Dense(4), Switch(name="switch")

    def call(self, x):
        return self.switch(self.dense(x))


def test_einsum_experts_build_error_names_the_nested_layer_keras_io_switch_transformer():
    """keras.io text classification with a Switch Transformer: 16-bit inputs meet float32
    expert tensors in `tf.einsum`; Keras names only the outer block that was called."""
    build = lambda: Block(name="block")(keras.Input((4,)))  # noqa: E731
    keras.config.set_dtype_policy("mixed_bfloat16")
    plain = _raised(TypeError, build)
    keras.config.set_dtype_policy("float32")
    einsum_text = ("Tensors in list passed to 'inputs' of 'Einsum' Op have types "
                   "[bfloat16, float32] that don't all match.")
    assert einsum_text in str(plain) and "tfmp" not in str(plain)
    with _tfmp("mixed_bfloat16"):
        text = str(_raised(TypeError, build))
    assert "of 'block' (of type Block)" in text and einsum_text in text
    assert _tfmp_text("block/switch", "Switch") in text


# keras PR#19263: int8 quantization refused for float16 compute


def _small_model():
    return keras.Sequential([keras.Input((8,)), layers.Dense(16, activation="relu"),
                             layers.Dense(4, name="head")])


_KERAS_QUANTIZE = ("Quantization mode='int8' doesn't work well with compute_dtype='float16'. "
                   "Consider loading model/layer with another dtype policy such as "
                   "'mixed_bfloat16' or 'mixed_float16' before calling `quantize()`.")


def test_int8_quantize_after_mixed_float16_names_the_float32_copy_keras_pr_19263():
    """keras PR#19263: `model.quantize("int8")` refuses float16 compute and suggests
    'mixed_float16', the policy in use. Under tfmp the ValueError names the route that
    works, quantizing `tfmp.to_float32(model)`, which this test then takes."""
    keras.config.set_dtype_policy("mixed_float16")
    plain = _small_model()
    keras.config.set_dtype_policy("float32")
    assert str(_raised(ValueError, lambda: plain.quantize("int8"))) == _KERAS_QUANTIZE
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    with _tfmp("mixed_float16"):
        keras.utils.set_random_seed(0)
        model = _small_model()
        model.compile("sgd", "mse")
        model.fit(x, x[:, :4], epochs=1, batch_size=16, verbose=0)
    error = _raised(ValueError, lambda: model.quantize("int8"))
    assert str(error).startswith(_KERAS_QUANTIZE + "\n\n" + (
        f"tfmp: Keras refuses quantize('int8') for model {model.name!r}: it computes in float16 "
        "(dtype policy 'mixed_float16').\n"))
    assert "\nFix: quantize a float32 copy, same weights: quantized = tfmp.to_float32(model); " \
           "quantized.quantize('int8').\nGuide: " in str(error)
    copy = tfmp.to_float32(model)
    expected = copy.predict(x, verbose=0)  # float32, before quantizing
    copy.quantize("int8")
    assert copy.get_layer("head").kernel.dtype == "int8"
    got = copy.predict(x, verbose=0)
    # int8 weights and activations (abs-max scaling, 127 steps each side) over two layers:
    # each rounding moves a value by at most 1/254 of its range; 2**-5 of the output's
    # range bounds their sum here.
    np.testing.assert_allclose(got, expected, rtol=0, atol=2**-5 * np.abs(expected).max())


def test_int8_quantize_under_mixed_bfloat16_is_not_refused_keras_pr_19263():
    """keras PR#19263, the other 16-bit policy: Keras quantizes bfloat16 compute to int8 itself."""
    with _tfmp("mixed_bfloat16"):
        model = _small_model()
        model.compile("sgd", "mse")
    model.quantize("int8")
    assert model.get_layer("head").kernel.dtype == "int8"


# openxla/xla#43052: tanh then bilinear UpSampling2D under XLA on the CPU


def _upsampling_model():
    return keras.Sequential([keras.Input((4, 4, 2)), layers.Conv2D(2, 1, activation="tanh"),
                             layers.UpSampling2D(interpolation="bilinear", name="up"),
                             layers.Flatten(), layers.Dense(1)])


def _xla_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 4, 4, 2)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="the XLA failure is the CPU compiler's")
def test_bilinear_upsampling_under_xla_falls_back_with_one_warning_openxla_43052():
    """openxla/xla#43052: `tanh` then `UpSampling2D(interpolation="bilinear")`, mixed
    policy, `jit_compile=True`: XLA's CPU compiler stops the first step on a mixed-dtype
    TanhGrad. tfmp compiles that model without XLA, warning once; it then trains to
    float32's weights within bfloat16's rounding."""
    x, y = _xla_data()
    keras.config.set_dtype_policy("mixed_bfloat16")
    plain = _upsampling_model()
    keras.config.set_dtype_policy("float32")
    plain.compile("sgd", "mse", jit_compile=True)
    error = _raised(tf.errors.InternalError, lambda: plain.fit(x, y, verbose=0))
    assert "Seen floating point types of different precisions in %TanhGrad" in str(error)
    assert "but mixed precision is disallowed" in str(error)

    keras.utils.set_random_seed(0)
    reference = _upsampling_model()
    weights = reference.get_weights()
    reference.compile("sgd", "mse")
    reference.fit(x, y, batch_size=8, epochs=2, verbose=0)
    with _tfmp("mixed_bfloat16"):
        model = _upsampling_model()
        with pytest.warns(tfmp.PerformanceWarning) as caught:
            model.compile("sgd", "mse", jit_compile=True)
    [warning] = [w for w in caught if "XLA" in str(w.message)]
    assert str(warning.message) == (
        f"tfmp compiled model {model.name!r} with jit_compile=False: XLA cannot train its bfloat16 "
        "bilinear resizes.\nUpSampling2D(interpolation='bilinear') layers ['up']: XLA on the CPU refuses "
        "their gradient.\nFix: tfmp.enable(..., keep_float32=['up']) keeps XLA; jit_compile=False "
        "silences this.\nGuide: " + guide("xla-turned-off"))
    assert model.jit_compile is False
    model.set_weights(weights)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        # Two SGD steps from equal weights; bfloat16 activations (relative step 2**-8)
        # change each gradient by a few of its 2**-8 parts.
        np.testing.assert_allclose(got, expected, rtol=0, atol=2**-6 * max(1.0, np.abs(expected).max()))


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="the XLA failure is the CPU compiler's")
def test_bilinear_upsampling_kept_in_float32_trains_under_xla_openxla_43052():
    """openxla/xla#43052, the fix the warning names: the bilinear layer in float32 keeps XLA."""
    x, y = _xla_data()
    with _tfmp("mixed_bfloat16", keep_float32=["up"]):
        model = _upsampling_model()
        with warnings.catch_warnings():
            warnings.simplefilter("error", tfmp.PerformanceWarning)  # no fallback warning
            model.compile("sgd", "mse", jit_compile=True)
    assert model.jit_compile is True and model.get_layer("up").compute_dtype == "float32"
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
