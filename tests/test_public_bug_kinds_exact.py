"""Public mixed-precision bug reports on preprocessing layers whose result must be exact.

One test per report: plain Keras mixed precision gets the value wrong (shown
first, so the case stays a real one), then tfmp gets float32's value wherever the
layer runs: in a model, in a ``tf.data`` map, before or after ``compile``, and
after `tfmp.disable()` for a layer created while enabled. The last tests pin the
rule itself (`tfmp/_src/float32/exact_layers.py`): which layers it forces, when,
and how an exclusion undoes it.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp

POLICIES = ["mixed_bfloat16", "mixed_float16"]

#: 256 buckets of width 20/256 between 990 and 1010, and the centre of each: value i
#: belongs to bucket i, written down without any layer.
BOUNDARIES = [990 + 20 * i / 256 for i in range(1, 256)]
CENTRES = np.array([990 + 20 * (i + 0.5) / 256 for i in range(256)], "float32")
BUCKETS = np.arange(256)

RNG = np.random.default_rng(0)
#: keras-core#412 (a): adapted on 10000 + N(0, 1); 10000.3 normalized.
NEAR_10000 = (10000 + RNG.normal(size=(1000, 1))).astype("float32")
X_10000 = np.array([[10000.3]], "float32")
#: keras-core#412 (b): regression targets 1000 + 30 N(0, 1), un-normalized by the output layer.
TARGETS = (1000 + 30 * RNG.normal(size=(1000, 1))).astype("float32")
Z = np.array([[0.5], [-1.25]], "float32")


def _mapped(layer, values):
    """``layer`` applied in a ``tf.data`` map to one batch of ``values``, as NumPy."""
    dataset = tf.data.Dataset.from_tensor_slices(values).batch(len(values)).map(layer)
    return next(iter(dataset)).numpy()


def _predict(layer, x, *, dtype="float32", head=None):
    """A compiled ``Input -> layer [-> head]`` model's prediction of ``x``."""
    inputs = keras.Input(x.shape[1:], dtype=dtype)
    outputs = layer(inputs)
    model = keras.Model(inputs, head(outputs) if head else outputs)
    model.compile("sgd", "mse")
    return model.predict(x, verbose=0), model


def _why(model, path):
    """(compute dtype, output dtype, reason) of the layer at ``path`` in `tfmp.audit`."""
    [row] = [r for r in tfmp.audit(model).rows if r.path == path]
    return row.compute_dtype, row.output_dtype, row.why


def _float32_reference(make, x):
    """Plain Keras under float32: the value the 16-bit runs must give."""
    layer = make()
    return _predict(layer, x)[0]


def _adapted(data, **kwargs):
    layer = keras.layers.Normalization(**kwargs)
    layer.adapt(data)
    return layer


@pytest.mark.parametrize("policy", POLICIES)
def test_discretization_near_1000_keeps_every_bucket_tensorflow_43502(policy):
    """tensorflow#43502: `Discretization` of values around 1,000 into 256 buckets under
    a mixed policy: Keras casts the values to the compute dtype (bfloat16 keeps 8 bits,
    float16 11), so in a model or a `tf.data` map most values land in a wrong bucket."""
    keras.config.set_dtype_policy(policy)  # restored by conftest
    plain = keras.layers.Discretization(bin_boundaries=BOUNDARIES)
    keras.config.set_dtype_policy("float32")
    assert (_mapped(plain, CENTRES) != BUCKETS).sum() > 200  # the report's failure, plain Keras
    assert (_predict(plain, CENTRES[:, None])[0][:, 0] != BUCKETS).sum() > 200
    with tfmp.policy_scope(policy):
        layer = keras.layers.Discretization(bin_boundaries=BOUNDARIES, name="buckets")
        np.testing.assert_array_equal(_mapped(layer, CENTRES), BUCKETS)  # before any compile
        got, model = _predict(layer, CENTRES[:, None], head=keras.layers.Identity())
        np.testing.assert_array_equal(got[:, 0], BUCKETS)
        assert _why(model, "buckets") == ("float32", "int32", "exact preprocessing")
    np.testing.assert_array_equal(_mapped(layer, CENTRES), BUCKETS)  # after disable


def test_category_encoding_of_id_1999_under_bfloat16_keras_19583():
    """keras#19583: `CategoryEncoding` under mixed_bfloat16 casts integer ids to the
    compute dtype in a traced call (a model or a `tf.data` map): 1999 becomes 2000,
    the nearest bfloat16 value, and the wrong column is set."""
    ids = np.array([1999, 2001, 5], "int32")
    keras.config.set_dtype_policy("mixed_bfloat16")
    plain = keras.layers.CategoryEncoding(num_tokens=2048, output_mode="one_hot")
    keras.config.set_dtype_policy("float32")
    assert _mapped(plain, ids).argmax(-1).tolist() == [2000, 2000, 5]  # plain Keras
    assert _predict(plain, ids, dtype="int32")[0].argmax(-1).tolist() == [2000, 2000, 5]
    with tfmp.policy_scope("mixed_bfloat16"):
        layer = keras.layers.CategoryEncoding(num_tokens=2048, output_mode="one_hot")
        assert _mapped(layer, ids).argmax(-1).tolist() == [1999, 2001, 5]
        got, model = _predict(layer, ids, dtype="int32")
        assert got.argmax(-1).tolist() == [1999, 2001, 5] and got.dtype == np.float32
    encoded = _mapped(layer, ids)
    assert encoded.dtype == np.float32  # no parent in a tf.data map: float32, as computed
    assert encoded.argmax(-1).tolist() == [1999, 2001, 5]


@pytest.mark.parametrize("policy", POLICIES)
def test_normalization_adapted_near_10000_keras_core_412(policy):
    """keras-core#412 (a): `Normalization` adapted on 10000 + N(0, 1), then used in a
    16-bit model: 10000.3 is cast to the compute dtype before the mean is subtracted
    (bfloat16 rounds it to 10000, float16 too), and so is the mean: the output is 0
    instead of (10000.3 - mean) / std = 0.356."""
    expected = _float32_reference(lambda: _adapted(NEAR_10000), X_10000)
    np.testing.assert_allclose(expected, [[0.3563]], atol=1e-3)  # by hand: 0.3/std + (10000 - mean)/std
    keras.config.set_dtype_policy(policy)
    plain = _adapted(NEAR_10000)
    keras.config.set_dtype_policy("float32")
    assert abs(float(_predict(plain, X_10000)[0][0, 0]) - 0.3563) > 0.3  # plain Keras: 0
    with tfmp.policy_scope(policy):
        layer = _adapted(NEAR_10000)
        np.testing.assert_array_equal(_mapped(layer, X_10000), expected)
        got, _ = _predict(layer, X_10000)
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(_mapped(layer, X_10000), expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_normalization_invert_as_output_adapted_before_compile_keras_core_412(policy):
    """keras-core#412 (b): `Normalization(invert=True)` as the output layer, adapted on
    targets 1000 + 30 N(0, 1) before `compile()`. `adapt()` stores its mean and variance
    cast to the compute dtype; forcing the output to float32 at compile left them rounded,
    so the output claimed float32 and was off by up to 0.3 (2.31 in the report)."""
    expected = _float32_reference(lambda: _adapted(TARGETS, invert=True), Z)
    mean, std = TARGETS.astype("float64").mean(), TARGETS.astype("float64").std()
    np.testing.assert_allclose(expected[:, 0], mean + Z[:, 0] * std, rtol=1e-6)
    keras.config.set_dtype_policy(policy)
    plain = _adapted(TARGETS, invert=True)
    keras.config.set_dtype_policy("float32")
    assert np.abs(_predict(plain, Z)[0][:, 0] - expected[:, 0]).max() > 0.2  # plain Keras
    with tfmp.policy_scope(policy):
        layer = _adapted(TARGETS, invert=True)
        got, model = _predict(layer, Z)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_exact_layers_made_before_enable_are_forced_at_compile_with_their_state_cast_again():
    """A `Normalization` adapted (or given its mean) under plain Keras mixed_bfloat16
    keeps its mean in bfloat16; compiled while enabled it is forced ("exact
    preprocessing") and its mean cast again from float32. Inside the model it hands
    back the model's bfloat16, as every forced layer does (README's output-dtype rule)."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    adapted = _adapted(NEAR_10000, name="adapted")
    given = keras.layers.Normalization(mean=10000.0, variance=1.0, name="given")
    given.build((None, 1))
    with tfmp.policy_scope("mixed_bfloat16"):
        inputs = keras.Input((1,))
        ones = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
        model = keras.Model(inputs, [ones(adapted(inputs)), given(inputs)])
        model.compile("sgd", "mse")
    via_dense, direct = model.predict(X_10000, verbose=0)
    keras.config.set_dtype_policy("float32")
    expected = _float32_reference(lambda: _adapted(NEAR_10000), X_10000)
    # The normalized value reaches the Dense in bfloat16 (8 bits): 2**-8 relative.
    np.testing.assert_allclose(via_dense, expected, rtol=2**-8)
    np.testing.assert_array_equal(direct, [[np.float32(10000.3) - 10000]])
    assert _why(model, "adapted") == ("float32", "bfloat16", "exact preprocessing")
    assert _why(model, "given") == ("float32", "float32", "output")


def test_the_rule_forces_exact_layers_made_while_enabled_unless_excluded():
    """The creation hook: only while a session is open, only the listed Keras classes,
    never a class the session excludes; a path exclusion, known only at compile,
    puts the layer back to the policy it was made with."""
    assert keras.layers.Normalization().dtype_policy.name == "float32"  # global float32
    with tfmp.policy_scope("mixed_bfloat16"):
        assert keras.layers.Normalization().dtype_policy.name == "float32"
        assert keras.layers.Dense(1).dtype_policy.name == "mixed_bfloat16"
        assert [r.class_path.rsplit(".", 1)[1] for r in tfmp.float32_layers().exact_preprocessing] == [
            "Discretization", "CategoryEncoding", "Normalization"]
    with tfmp.policy_scope("mixed_bfloat16", exclude_float32=keras.layers.CategoryEncoding):
        assert keras.layers.CategoryEncoding(num_tokens=3).dtype_policy.name == "mixed_bfloat16"
    with tfmp.policy_scope("mixed_bfloat16", exclude_float32="keep16"):
        layer = keras.layers.Normalization(mean=0.0, variance=1.0, name="keep16")
        assert layer.dtype_policy.name == "float32"
        inputs = keras.Input((2,))
        model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
        model.compile("sgd", "mse")
        assert layer.dtype_policy.name == "mixed_bfloat16" and layer.mean.dtype == tf.bfloat16
        assert _why(model, "keep16") == ("bfloat16", "bfloat16", "")
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert keras.layers.Normalization().dtype_policy.name == "mixed_bfloat16"  # no session: plain Keras
