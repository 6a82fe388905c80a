"""A loss-scale state no run reaches is refused where it enters; a Lambda's hidden dtype mismatch is named.

1. A scale NaN, inf, 0 or negative, or a negative counter, written into a saved file (``.weights.h5``,
   ``.keras``) or a ``tf.train.Checkpoint``: plain Keras loads it silently and then trains on it (NaN weights
   at scale 0); tfmp refuses it naming the variable, its value and the fix, before anything is assigned
   (files) or before a step writes (a checkpoint, at ``fit``), and a stuck run at such a scale names the scale,
   not the data. Sound files load as before, both ways.
2. ``Lambda(lambda t: tf.add(t, tf.constant(1.0)))`` in a Functional model under a 16-bit policy: Keras says
   only that it could not infer the Lambda's shape; under tfmp the same error names the Lambda, both dtypes
   and the fix.
3. ``tf.lite.TFLiteConverter`` on a model still in 16 bits: the converter lists ops and MLIR types; under tfmp
   its error names the 16-bit dtype, where, and ``tfmp.to_float32``. ``tfmp.export`` of a layer casting to a
   fixed 16-bit dtype says so instead of "an op TFLite lacks".
"""

import shutil
import warnings

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.keras_hooks.export_io import tflite_converter_error
from tfmp._src.loss_scale import saved_form

X = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
Y = X[:, :2] * 2.0


@pytest.fixture(autouse=True)
def always_disable():
    yield
    tfmp.disable()


#: The loss scale `sound_file` saves.
SAVED_SCALE = 2.0**11


def _enable(policy="mixed_float16"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # 16 bits slower than float32 on this CPU
        tfmp.enable(policy, verbose=False)


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])


def _tfmp_model():
    """A model compiled under tfmp (enabled by the caller), its optimizer built."""
    model = _model()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _plain_keras_model():
    """The same model in plain Keras: Keras's policy and its LossScaleOptimizer, built."""
    keras.config.set_dtype_policy("mixed_float16")  # conftest restores the global policy
    model = _model()
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.fixture(scope="module")
def sound_file(tmp_path_factory):
    """A ``.weights.h5`` of a model trained under tfmp (mixed_float16), and its loss scale (`SAVED_SCALE`:
    not a fresh optimizer's, so that only a load restores it, whatever the steps did to it)."""
    path = tmp_path_factory.mktemp("state") / "sound.weights.h5"
    _enable()
    try:
        model = _tfmp_model()
        model.fit(X, Y, batch_size=4, verbose=0)
        model.optimizer.dynamic_scale.assign(SAVED_SCALE)
        model.save_weights(path)
        scale = model.optimizer.loss_scale
    finally:
        tfmp.disable()
    return path, scale


def _h5_key(optimizer, name):
    """Where `name` lies in the weights file: Keras's group for its variables, tfmp's for the counters."""
    counters = [v.name for v in optimizer.counter_variables()]
    if name in counters:
        return f"optimizer/loss_scale_counters/vars/{counters.index(name)}"
    return f"optimizer/vars/{[v.name for v in saved_form.keras_layout(optimizer)].index(name)}"


IMPOSSIBLE = [("dynamic_scale", np.nan, "nan"), ("dynamic_scale", np.inf, "inf"), ("dynamic_scale", 0.0, "0.0"),
              ("dynamic_scale", -8.0, "-8.0"), ("consecutive_overflows", -5, "-5"), ("total_steps", -1, "-1"),
              ("step_counter", -3, "-3"), ("last_overflow_step", -2, "-2")]


@pytest.mark.parametrize("name, value, shown", IMPOSSIBLE, ids=[f"{n}={s}" for n, _, s in IMPOSSIBLE])
def test_an_impossible_state_in_a_weights_file_is_refused_naming_it_where_plain_keras_loads_it(
        sound_file, tmp_path, name, value, shown):
    sound, _ = sound_file
    path = tmp_path / "bad.weights.h5"
    shutil.copy(sound, path)
    _enable()
    model = _tfmp_model()
    with h5py.File(path, "r+") as file:
        file[_h5_key(model.optimizer, name)][()] = value
    before = getattr(model.optimizer, name).numpy()

    with pytest.raises(ValueError) as info:
        model.load_weights(path)

    text = str(info.value)
    assert f"Invalid `{name}` loaded into optimizer {model.optimizer.name!r}." in text
    assert f"Received: {name}={shown} (of type " in text
    assert "Fix: re-save it from a sound run" in text and "load_model(path, compile=False)" in text
    # Refused before its group was assigned (Keras goes on with the other groups, then raises).
    assert getattr(model.optimizer, name).numpy() == before
    tfmp.disable()
    # Plain Keras loads the same file without a word; its scale is whatever the file says.
    plain = _plain_keras_model()
    plain.load_weights(path)
    if name == "dynamic_scale":
        np.testing.assert_array_equal(plain.optimizer.dynamic_scale.numpy(), np.float32(value))


def test_a_sound_file_loads_under_tfmp_and_in_plain_keras(sound_file):
    path, scale = sound_file
    _enable()
    model = _tfmp_model()
    assert model.optimizer.loss_scale != SAVED_SCALE  # a fresh optimizer's
    model.load_weights(path)
    assert model.optimizer.loss_scale == scale == SAVED_SCALE
    assert int(model.optimizer.total_steps.numpy()) == 4
    tfmp.disable()
    plain = _plain_keras_model()
    plain.load_weights(path)
    assert float(plain.optimizer.dynamic_scale.numpy()) == scale


def test_a_keras_file_with_scale_zero_is_refused_and_opens_without_its_optimizer(tmp_path):
    _enable()
    model = _tfmp_model()
    model.fit(X, Y, batch_size=8, verbose=0)
    model.optimizer.dynamic_scale.assign(0.0)  # saving writes what it holds
    model.save(tmp_path / "bad.keras")
    with pytest.raises(ValueError, match=r"Invalid `dynamic_scale` loaded into optimizer .* "
                       r"Received: dynamic_scale=0\.0 \(of type float\)"):
        keras.models.load_model(tmp_path / "bad.keras")
    # The fix the message gives: the weights without the optimizer, then a new compile.
    loaded = keras.models.load_model(tmp_path / "bad.keras", compile=False)
    for saved, back in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(saved, back)


def _checkpointed_at_scale_zero(model, folder):
    """A tf.train.Checkpoint of `model` whose scale is 0, restored after the scale was set back."""
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    model.optimizer.dynamic_scale.assign(0.0)
    path = checkpoint.save(str(folder / "ckpt"))
    model.optimizer.dynamic_scale.assign(2.0**15)
    checkpoint.restore(path)
    assert float(model.optimizer.dynamic_scale.numpy()) == 0.0  # restored silently


def test_a_checkpoint_with_scale_zero_is_refused_at_fit_before_a_step_where_plain_keras_trains_to_nan(tmp_path):
    keras.config.set_dtype_policy("float32")
    reference = _model()
    reference.compile(keras.optimizers.SGD(0.05), "mse")
    reference_loss = reference.fit(X, Y, batch_size=4, epochs=2, verbose=0).history["loss"][-1]
    assert np.isfinite(reference_loss)

    plain = _plain_keras_model()
    _checkpointed_at_scale_zero(plain, tmp_path / "plain")
    plain.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    assert np.isnan(plain.get_weights()[0]).all()  # 0/0 gradients written, no word

    _enable()
    model = _tfmp_model()
    _checkpointed_at_scale_zero(model, tmp_path / "tfmp")
    weights = model.get_weights()
    with pytest.raises(ValueError, match=r"Invalid `dynamic_scale` in optimizer .* Received: dynamic_scale=0\.0 "
                       r".*Fix: restore a sound checkpoint, or reset it: optimizer\.dynamic_scale\.assign\(32768"):
        model.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    for old, new in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("scale", [0.0, -4.0, np.nan, np.inf])
def test_a_custom_loop_step_at_an_impossible_scale_is_skipped_and_said_as_the_scale_not_the_data(scale):
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), min_scale=2.0)
    variable = keras.Variable(np.ones((2,), "float32"))
    optimizer.build([variable])
    optimizer.dynamic_scale.assign(scale)  # as a checkpoint restore would

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * variable)
        optimizer.apply(tfmp.scaled_gradients(tape, loss, [variable], optimizer), [variable])

    step()
    np.testing.assert_array_equal(variable.numpy(), [1.0, 1.0])  # skipped: no 0/0 or x/inf written
    assert optimizer.loss_scale == 2.0  # min_scale
    with pytest.warns(tfmp.SkippedStepWarning) as record:
        optimizer.raise_if_stuck()
    text = str(record[0].message)
    assert "The loss scale itself was not a finite number > 0" in text and "data pipeline" not in text
    step()
    np.testing.assert_allclose(variable.numpy(), [0.8, 0.8], rtol=1e-6)  # SGD(0.1) on 2 * 1.0: trains again


LAMBDA_CASES = [("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")]


def _functional_with_shifting_lambda():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8)(inputs)
    hidden = keras.layers.Lambda(lambda t: tf.add(t, tf.constant(1.0)), name="shift")(hidden)
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


@pytest.mark.parametrize("policy, low", LAMBDA_CASES)
def test_a_lambda_adding_a_float32_constant_is_named_where_keras_only_says_it_cannot_infer_the_shape(policy, low):
    keras.config.set_dtype_policy(policy)  # plain Keras
    with pytest.raises(NotImplementedError) as plain:
        _functional_with_shifting_lambda()
    assert "could not automatically infer the shape of the Lambda's output" in str(plain.value)
    assert "tfmp:" not in str(plain.value) and "float32" not in str(plain.value)
    keras.config.set_dtype_policy("float32")

    _enable(policy)
    with pytest.raises(NotImplementedError) as info:
        _functional_with_shifting_lambda()
    text = str(info.value)
    assert f"tfmp: Layer 'shift' (Lambda) mixes {low} and float32 tensors" in text
    assert "tf.cast(t, x.dtype)" in text and 'create Lambda with dtype="float32"' in text
    assert "register_float32" not in text  # acts at compile: no help to a model that never builds
    # The fix it names builds: the constant cast to the input's dtype.
    inputs = keras.Input((4,))
    hidden = keras.layers.Lambda(lambda t: tf.add(t, tf.cast(tf.constant(1.0), t.dtype)))(
        keras.layers.Dense(8)(inputs))
    assert keras.Model(inputs, hidden).output.dtype == low


def _dense_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])


def _run_tflite(flatbuffer, x):
    interpreter = tflite_interpreter_from(flatbuffer)
    runner = interpreter.get_signature_runner()
    return next(iter(runner(**{runner.get_input_details().popitem()[0]: x}).values()))


def tflite_interpreter_from(flatbuffer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tf.lite.Interpreter's move notice
        return tf.lite.Interpreter(model_content=flatbuffer)


@pytest.mark.parametrize("policy, low", LAMBDA_CASES)
def test_a_plain_tflite_conversion_of_a_16bit_model_names_the_dtype_the_layer_and_to_float32(policy, low):
    keras.config.set_dtype_policy(policy)  # plain Keras: the converter's ops and MLIR types only
    plain = _dense_model()
    plain(X[:1])
    with pytest.raises(tflite_converter_error()) as refused:
        tf.lite.TFLiteConverter.from_keras_model(plain).convert()
    assert "tfmp" not in str(refused.value) and "neither a custom op nor a flex op" in str(refused.value)
    keras.config.set_dtype_policy("float32")

    _enable(policy)
    model = _dense_model()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(X, Y, batch_size=8, verbose=0)
    with pytest.raises(tflite_converter_error()) as info:
        tf.lite.TFLiteConverter.from_keras_model(model).convert()
    text = str(info.value)
    assert f"tfmp: The model converted still computes in {low} (first in the ops of '" in text
    assert "/dense" in text and "from_keras_model(tfmp.to_float32(model))" in text
    assert "neither a custom op nor a flex op" in text  # the converter's words kept
    # The fix it names converts, and the file computes the trained model's outputs (float32 reference).
    copy = tfmp.to_float32(model)
    produced = _run_tflite(tf.lite.TFLiteConverter.from_keras_model(copy).convert(), X)
    np.testing.assert_allclose(produced, copy.predict(X, verbose=0), rtol=1e-5, atol=1e-5)
    tolerance = 0.05 if low == "bfloat16" else 0.005
    np.testing.assert_allclose(produced, model.predict(X, verbose=0).astype("float32"), atol=tolerance)


class _FixedBfloat16(keras.layers.Layer):
    """User code computing in a fixed 16-bit dtype, which the float32 copy keeps."""

    def call(self, x):
        return keras.ops.cast(keras.ops.cast(x, "bfloat16") * 2.0, self.compute_dtype)


def test_export_of_a_layer_casting_to_a_fixed_16bit_dtype_says_so_instead_of_an_op_tflite_lacks(tmp_path):
    _enable("mixed_bfloat16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), _FixedBfloat16(name="half"),
                              keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(X, Y, batch_size=8, verbose=0)
    with pytest.raises(ValueError) as info:
        tfmp.export(model, tmp_path / "m.tflite", format="tflite")
    text = str(info.value)
    assert "at layer 'half' (TensorFlow ops Mul); the op computes in bfloat16 although the copy's policies" in text
    assert "cast to the layer's self.compute_dtype instead" in text and "not a mixed-precision one" not in text
    assert isinstance(info.value.__cause__, tflite_converter_error())
