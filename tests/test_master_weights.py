"""16-bit trainable variables of a mixed-precision model: tfmp.LossScaleOptimizer keeps float32 master
copies of them (trained as float32 variables are, saved in Keras's layout); a model whose optimizer
tfmp does not wrap is told once, naming them."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _subproc import plain_keras_load

import tfmp
from tfmp._src.float32.master_weights import SCOPE


class Scale(keras.layers.Layer):
    """A layer whose author stores its weights in `dtype` whatever the policy."""

    def __init__(self, dtype_of_weights=None, **kwargs):
        super().__init__(**kwargs)
        self.dtype_of_weights = dtype_of_weights

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(input_shape[-1],), initializer="ones", dtype=self.dtype_of_weights,
                                    name="gain")
        self.steps = self.add_weight(shape=(), initializer="zeros", dtype="bfloat16", trainable=False,
                                     name="steps")  # not trained: nothing to say

    def call(self, x):
        return x * keras.ops.cast(self.gain, x.dtype)


def _model(dtype_of_weights):
    return keras.Sequential([keras.Input((4,)), Scale(dtype_of_weights, name="scale"),
                             keras.layers.Dense(1, name="out")])


@pytest.mark.parametrize("policy, dtype, effect", [
    ("mixed_bfloat16", "bfloat16", "updates below 2**-8 of a bfloat16 weight round away"),
    ("mixed_float16", "float16", "updates below 2**-11 of a float16 weight round away"),
])
def test_a_16_bit_trainable_variable_without_tfmps_optimizer_is_named_with_its_effect_and_fix(
        policy, dtype, effect, tmp_path):
    keras.config.set_dtype_policy(policy)  # plain Keras trains and saves it (restored by conftest)
    model = _model(dtype)
    model.compile(keras.optimizers.SGD(), "mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    model.save(tmp_path / "plain.keras")
    with tfmp.policy_scope(policy):
        with pytest.warns(UserWarning, match="trains 1 variable") as caught:
            loaded = keras.models.load_model(tmp_path / "plain.keras", custom_objects={"Scale": Scale})
        assert not isinstance(loaded.optimizer, tfmp.LossScaleOptimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # once per model
            warnings.simplefilter("ignore", tfmp.PerformanceWarning)
            loaded.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    text = [str(w.message) for w in caught if "trains 1 variable" in str(w.message)][0]
    assert f"'scale/gain' ({dtype})" in text and "steps" not in text
    assert "(not a tfmp.LossScaleOptimizer)" in text and effect in text and "pass dtype='float32'" in text
    assert loaded.get_layer("scale").gain.dtype == dtype  # said, not changed


@pytest.mark.parametrize("built_at", ["compile", "fit"])
def test_tfmps_optimizer_keeps_master_copies_and_says_nothing(built_at):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.scale, self.out = Scale("bfloat16", name="scale"), keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.scale(x))

    with tfmp.policy_scope("mixed_bfloat16"), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = _model("bfloat16") if built_at == "compile" else Net()  # Net: built at fit
        model.compile("adam", "mse")
        model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    (variable, copy), = model.optimizer.master_copies.pairs
    assert variable is (model.scale if built_at == "fit" else model.get_layer("scale")).gain
    assert copy.dtype == "float32" and variable.dtype == "bfloat16"


# -- master copies: trained as float32 is --------------------------------------------------------------


class LowGain(keras.layers.Layer):
    """Stores its gain in the compute dtype (`add_weight(dtype=self.compute_dtype)`), RoPE-style."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(input_shape[-1],), initializer="ones", dtype=self.compute_dtype,
                                    name="gain")

    def call(self, x):
        return x * keras.ops.cast(self.gain, x.dtype)


_X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
_Y = _X @ np.array([[0.5], [-1.0], [2.0], [1.5]], "float32")
STEPS = 32
#: Per dtype: Adam's learning rate, and the tolerance of |tfmp's 16-bit gain - the float32 reference's| after
#: STEPS: one spacing of the dtype at 1.0 (the gain is its float32 copy rounded). The rates make Keras's
#: 16-bit update fail: bfloat16's beta_2 rounds to 1.0 (bias correction 0, no move at any rate); a float16
#: update of 2e-4 is below half float16's spacing at 1.0 (2**-11) and rounds away.
SETTINGS = {"bfloat16": (1e-2, 2.0**-7), "float16": (2e-4, 2.0**-10)}
#: First loss scale under float16, for tfmp and for plain Keras: 2**15 overflows the first steps, which a
#: dynamic scale skips, and skipped steps would make the gain lag whatever it is stored in.
FLOAT16_SCALE = 2.0**4


def _low_gain_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), LowGain(name="scale"), keras.layers.Dense(1, name="out")])


def _trained_gain(model, optimizer):
    model.compile(optimizer, "mse")
    model.fit(_X, _Y, batch_size=len(_X) // 4, epochs=STEPS // 4, shuffle=False, verbose=0)
    return keras.ops.convert_to_numpy(keras.ops.cast(model.get_layer("scale").gain, "float32"))


def _plain_keras_gain(policy, learning_rate):
    keras.config.set_dtype_policy(policy)
    try:
        optimizer = keras.optimizers.Adam(learning_rate)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=FLOAT16_SCALE)
        return _trained_gain(_low_gain_model(), optimizer)
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_adam_trains_a_16_bit_variable_as_float32_where_plain_keras_does_not(policy):
    dtype = policy.removeprefix("mixed_")
    learning_rate, tolerance = SETTINGS[dtype]
    reference = _plain_keras_gain("float32", learning_rate)
    plain = _plain_keras_gain(policy, learning_rate)
    options = {"initial_scale": FLOAT16_SCALE} if dtype == "float16" else {}
    with tfmp.policy_scope(policy, loss_scale_options=options), warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # float16 on a CPU
        model = _low_gain_model()
        gain = _trained_gain(model, keras.optimizers.Adam(learning_rate))
    assert np.abs(reference - 1.0).max() > 6 * tolerance  # the reference moves the gain
    assert np.abs(plain - reference).max() > 3 * tolerance
    assert np.abs(gain - reference).max() < tolerance
    assert int(model.optimizer.overflow_count.numpy()) == 0
    variable = model.get_layer("scale").gain
    assert variable.dtype == dtype  # what user code sees stays 16-bit
    (kept, copy), = model.optimizer.master_copies.pairs
    assert kept is variable and copy.dtype == "float32"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.ops.cast(copy, dtype)),
                                  keras.ops.convert_to_numpy(variable))


def test_a_skipped_step_leaves_the_variable_and_its_copy():
    with tfmp.policy_scope("mixed_bfloat16"):
        model = _low_gain_model()
        _trained_gain(model, keras.optimizers.Adam(SETTINGS["bfloat16"][0]))
        optimizer = model.optimizer
        (variable, copy), = optimizer.master_copies.pairs
        before = [keras.ops.convert_to_numpy(v).copy() for v in (variable, copy)]
        grads = [keras.ops.ones_like(v) for v in model.trainable_variables]
        grads[0] = keras.ops.full_like(grads[0], np.nan)  # the gain's gradient
        with pytest.warns(tfmp.SkippedStepWarning):
            optimizer.apply(grads, model.trainable_variables)
        assert int(optimizer.overflow_count.numpy()) == 1
        for kept, value in zip((variable, copy), before):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(kept), value)
        grads[0] = keras.ops.ones_like(grads[0])
        optimizer.apply(grads, model.trainable_variables)  # the next finite step moves both
        assert not np.array_equal(keras.ops.convert_to_numpy(copy), before[1])


def test_a_file_saved_under_tfmp_opens_in_plain_keras_and_the_copies_come_back_from_the_loaded_values(tmp_path):
    # A built-in layer with a pure bfloat16 policy in a mixed model: plain Keras opens it without tfmp's code.
    with tfmp.policy_scope("mixed_bfloat16"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, dtype="bfloat16", name="low"),
                                  keras.layers.Dense(1, name="out")])
        model.compile(keras.optimizers.Adam(SETTINGS["bfloat16"][0]), "mse")
        model.fit(_X, _Y, batch_size=16, epochs=1, verbose=0)
        optimizer = model.optimizer
        assert len(optimizer.master_copies.pairs) == 2  # kernel and bias
        path = tmp_path / "model.keras"
        model.save(path)
        found = plain_keras_load(path, tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # the optimizer keeps copies: nothing to say
            warnings.filterwarnings("ignore", "Model .* was saved under")
            loaded = keras.models.load_model(path)
        low = loaded.get_layer("low")
        low.kernel.assign(keras.ops.full_like(low.kernel, 0.5))  # as set_weights would
        loaded.optimizer.learning_rate = 0.0
        loaded.train_on_batch(_X[:8], _Y[:8])
    assert found["tfmp_imported"] is False
    assert not [w for w in found["warnings"] if "Skipping variable loading" in w], found["warnings"]
    # Keras's layout: the slots of the 16-bit variables (float32 under tfmp) load into plain Keras's 16-bit ones.
    inner = optimizer.inner_optimizer.variables
    assert len(found["inner_variables"]) == len(inner)
    for saved, opened in zip(inner, found["inner_variables"], strict=True):  # bfloat16 rounding: < 2**-8 relative
        np.testing.assert_allclose(np.asarray(opened, "float32"), keras.ops.convert_to_numpy(saved), rtol=2.0**-8)
    for saved, opened in zip(model.get_weights(), found["weights"], strict=True):
        np.testing.assert_array_equal(saved, np.asarray(opened, saved.dtype))
    assert np.isfinite(found["loss_after_one_step"])
    # Under tfmp the copies start from the loaded (and then assigned) values, not from the initial ones.
    kernel_copy = loaded.optimizer.master_copies.copies[0]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(kernel_copy), 0.5)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.ops.cast(loaded.optimizer.master_copies.copies[1],
                                                                            "bfloat16")).astype("float32"),
                                  np.asarray(found["weights"][1], "float32"))


def _step_graph_ops(model):
    """Names of the ops of `model`'s traced optimizer step, those of its `tf.cond` branches included."""
    step = tf.function(lambda: model.optimizer.apply([keras.ops.zeros_like(v) for v in model.trainable_variables],
                                                     model.trainable_variables))
    graph = step.get_concrete_function().graph.as_graph_def()
    return [node.name for node in graph.node] + [
        node.name for function in graph.library.function for node in function.node_def]


def test_a_model_without_16_bit_variables_gets_no_copies_and_the_same_step():
    with tfmp.policy_scope("mixed_bfloat16"):
        plain = _model(None)  # the policy's float32 variables
        plain.compile("adam", "mse")
        plain.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
        low = _model("bfloat16")
        low.compile("adam", "mse")
        low.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
        assert not plain.optimizer.master_copies and not plain.optimizer.master_copies.pairs
        assert not [name for name in _step_graph_ops(plain) if SCOPE in name]
        assert [name for name in _step_graph_ops(low) if SCOPE in name]  # where copies are kept, they show


def test_master_copies_under_a_mirrored_strategy_train_as_without_one():
    def trained(strategy):
        with tfmp.policy_scope("mixed_bfloat16"), strategy.scope():
            model = _low_gain_model()
            gain = _trained_gain(model, keras.optimizers.Adam(SETTINGS["bfloat16"][0]))
        return model, gain

    _, alone = trained(tf.distribute.get_strategy())
    model, mirrored = trained(tf.distribute.MirroredStrategy(["/cpu:0"]))
    (variable, copy), = model.optimizer.master_copies.pairs
    assert isinstance(variable.value, tf.distribute.DistributedValues)
    assert isinstance(copy.value, tf.distribute.DistributedValues)
    np.testing.assert_allclose(mirrored, alone, atol=2.0**-8)  # bfloat16 rounding of a different reduction order
    assert np.abs(alone - 1.0).max() > 6 * SETTINGS["bfloat16"][1]
