"""A 16-bit dropout under tfmp drops its rate: each value decided on 16 random bits (`float32/dropout_draw.py`).

TensorFlow draws a dropout's noise in the inputs' dtype (steps of 1/128 in bfloat16, 1/1024 in
float16), so plain Keras drops ``ceil(rate * steps) / steps``: 3.9x the rate at 0.002 in
bfloat16. Each count is checked against the rate within a binomial bound, beside plain Keras's
(``keras.config.set_dtype_policy``, no tfmp) and a float32 reference.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _premises import require
from scipy import stats

import tfmp
from tfmp._src.attachment import hooks as attachment_hooks
from tfmp._src.float32 import dropout_draw
from tfmp._src.keras_hooks import backend_ops

#: Draws per count: with `ALPHA`, the bound around ``rate * DRAWS`` is about 5 standard deviations
#: wide, below the nearest biased count (float16's Dropout(0.01): 1.07x the rate, 7.7 deviations).
DRAWS = 1 << 20
#: Chance that an unbiased count falls outside `binomial_bound` (the seeds are fixed: it never flakes).
ALPHA = 1e-6
#: Channels and steps of the SpatialDropout1D input: one draw per sample and channel.
CHANNELS, STEPS = 4096, 2

CASES = [("Dropout", 0.002), ("Dropout", 0.01), ("SpatialDropout1D", 0.01)]


def binomial_bound(rate, draws=DRAWS):
    """The (low, high) dropped counts an unbiased draw of `rate` stays within but with chance `ALPHA`."""
    return stats.binom.ppf(ALPHA / 2, draws, rate), stats.binom.isf(ALPHA / 2, draws, rate)


def _layer_and_input(kind, rate):
    if kind == "SpatialDropout1D":  # noise shape (batch, 1, channels)
        return keras.layers.SpatialDropout1D(rate, seed=1), np.ones((DRAWS // CHANNELS, STEPS, CHANNELS), "float32")
    return keras.layers.Dropout(rate, seed=1), np.ones((DRAWS // 1024, 1024), "float32")


def _compiled(layer, x):
    model = keras.Sequential([keras.Input(x.shape[1:]), layer, keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def _dropped(layer, x):
    """Dropped draws of `layer` called in training on `x` (a spatial layer's: the first step's), the output's dtype."""
    y = layer(tf.cast(x, layer.compute_dtype), training=True)
    zeros = tf.equal(y, 0).numpy()
    return int(zeros[:, 0].sum() if zeros.ndim == 3 else zeros.sum()), y.dtype.name


def _plain_keras(policy, make):
    keras.config.set_dtype_policy(policy)
    try:
        return make()
    finally:
        keras.config.set_dtype_policy("float32")


def _under_tfmp(policy, make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 16 bits on a CPU: PerformanceWarning
        with tfmp.policy_scope(policy, verbose=False):
            return make()


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("kind, rate", CASES)
def test_a_16_bit_dropout_drops_its_rate_under_tfmp_where_plain_keras_drops_more(policy, kind, rate):
    def run():
        layer, x = _layer_and_input(kind, rate)
        model = _compiled(layer, x)
        return _dropped(layer, x), tfmp.attachment(model)

    low, high = binomial_bound(rate)
    reference, _ = _plain_keras("float32", run)
    (ours, dtype), found = _under_tfmp(policy, run)
    (plain, plain_dtype), _ = _plain_keras(policy, run)
    assert low <= reference[0] <= high, (reference, low, high)  # float32: unbiased
    assert low <= ours <= high, (ours, low, high, plain)
    assert dtype == plain_dtype == policy.split("_")[1]
    assert found.dropout.startswith(dropout_draw.EXACT_DRAW)
    require(plain > high, f"plain Keras's {policy} {kind}({rate}) drops more than its rate "
                          f"(dropped {plain} of {DRAWS}, bound {high:.0f}): TensorFlow draws in the inputs' dtype")


@pytest.mark.parametrize("kind, rate", CASES)
def test_a_float32_model_keeps_kerass_dropout(kind, rate):
    def run():
        layer, x = _layer_and_input(kind, rate)
        model = _compiled(layer, x)
        return _dropped(layer, x), tfmp.attachment(model)

    (ours, dtype), found = _under_tfmp("float32", run)
    (plain, _), _ = _plain_keras("float32", run)
    low, high = binomial_bound(rate)
    assert found.dropout == dropout_draw.KERAS and dtype == "float32"
    assert ours == plain and low <= ours <= high  # the same seed: the same draws


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("rate", [0.002, 0.3])
def test_kept_values_are_scaled_by_one_over_one_minus_rate_and_rounded_once(policy, rate):
    x = np.random.default_rng(0).normal(size=(256, 1024)).astype("float32")

    def run():
        layer = keras.layers.Dropout(rate, seed=3)
        _compiled(layer, x)
        return layer(tf.cast(x, layer.compute_dtype), training=True)

    y = _under_tfmp(policy, run)
    dtype = policy.split("_")[1]
    assert y.dtype.name == dtype
    x16 = tf.cast(x, dtype)
    kept = (y.numpy() != 0) & (x16.numpy() != 0)
    wide = tf.cast(x16, tf.float32).numpy()
    expected = tf.cast(wide / np.float32(1.0 - rate), dtype).numpy()  # float32 scaling, rounded once
    assert kept.mean() > 0.5
    np.testing.assert_array_equal(y.numpy()[kept], expected[kept])


def _spy(monkeypatch, name="exact_draw"):
    """A list growing by one at each call of `dropout_draw`'s function `name`, which still runs."""
    calls = []
    original = getattr(dropout_draw, name)
    monkeypatch.setattr(dropout_draw, name, lambda *a: calls.append(1) or original(*a))
    return calls


def test_a_detached_model_and_one_tfmp_did_not_attach_run_kerass_own_dropout(monkeypatch):
    """With the hook on (a session open), neither runs tfmp's draw: both give plain Keras's output."""
    calls = _spy(monkeypatch)
    x = np.ones((64, 1024), "float32")

    def plain_output():
        layer = keras.layers.Dropout(0.002, seed=5)
        return layer(tf.cast(x, layer.compute_dtype), training=True).numpy()

    expected = _plain_keras("mixed_bfloat16", plain_output)
    assert np.count_nonzero(expected == 0) > 0.004 * x.size  # Keras's biased draw (0.78%)
    unattached = _plain_keras("mixed_bfloat16", lambda: _compiled(keras.layers.Dropout(0.002, seed=5), x))

    def outputs():
        assert "dropout" in {hook.owner for hook in attachment_hooks.installed()}
        detached_layer = keras.layers.Dropout(0.002, seed=5)
        detached = _compiled(detached_layer, x)
        assert tfmp.attachment(detached).dropout.startswith(dropout_draw.EXACT_DRAW)
        tfmp.detach(detached)
        results = [layer(tf.cast(x, "bfloat16"), training=True).numpy()
                   for layer in (unattached.layers[0], detached_layer)]
        assert tfmp.attachment(unattached) is None and tfmp.attachment(detached) is None
        return results

    for output in _under_tfmp("mixed_bfloat16", outputs):
        np.testing.assert_array_equal(output, expected)
    assert calls == []


def test_keras_random_dropout_in_a_user_layer_draws_in_float32_in_an_attached_model(monkeypatch):
    calls = _spy(monkeypatch)

    class UserDropout(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed = keras.random.SeedGenerator(7)

        def call(self, x, training=False):
            return keras.random.dropout(x, 0.002, seed=self.seed) if training else x

    x = np.ones((DRAWS // 1024, 1024), "float32")

    def run():
        layer = UserDropout()
        model = _compiled(layer, x)
        model.fit(x[:8], np.ones((8, 1), "float32"), batch_size=8, verbose=0)  # the traced step too
        return _dropped(layer, x)

    low, high = binomial_bound(0.002)
    ours, dtype = _under_tfmp("mixed_bfloat16", run)
    assert dtype == "bfloat16" and low <= ours <= high and len(calls) == 2  # fit's trace, then the eager call
    plain, _ = _plain_keras("mixed_bfloat16", run)
    require(plain > high, "keras.random.dropout in bfloat16 drops more than its rate")


def test_keras_still_calls_the_backend_dropout_by_module_attribute():
    """The contract the hook relies on: Dropout, SpatialDropout1D and ``keras.random.dropout`` read
    ``backend.random.dropout`` at each call, and it drops in the inputs' dtype (a 16-bit draw)."""
    seen = []
    module = backend_ops.backend_random()
    original = module.dropout
    module.dropout = lambda inputs, *args, **kwargs: seen.append(inputs.dtype.name) or original(inputs, *args, **kwargs)
    x = tf.ones((DRAWS // 1024, 1024), "bfloat16")
    try:
        keras.layers.Dropout(0.5, seed=1)(x, training=True)
        keras.layers.SpatialDropout1D(0.5, seed=1)(tf.ones((2, 3, 4)), training=True)
        dropped = int(tf.reduce_sum(tf.cast(keras.random.dropout(x, 0.002, seed=1) == 0, tf.int32)))
    finally:
        module.dropout = original
    assert seen == ["float32", "float32", "bfloat16"]  # the layers cast to their float32 policy
    # the draw takes the inputs' dtype: bfloat16 steps of 1/128, so 0.002 drops 1/128
    assert dropped > binomial_bound(0.002)[1] and dropped > 0.5 * DRAWS / 128


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_the_exact_draw_advances_the_layers_seed_as_kerass_dropout_does(policy):
    x = np.ones((64, 32), "float32")

    def run():
        layer = keras.layers.Dropout(0.3, seed=5)
        _compiled(layer, x)
        for _ in range(3):
            layer(tf.cast(x, layer.compute_dtype), training=True)
        return layer.seed_generator.state.numpy()

    np.testing.assert_array_equal(_under_tfmp(policy, run), _plain_keras(policy, run))


def test_rates_the_exact_draw_cannot_hold_take_kerass_dropout_widened_to_float32(monkeypatch):
    assert dropout_draw._exact_rate(0.5) and dropout_draw._exact_rate(2.0**-16)
    for rate in (0.0, 1e-6, 1.0 - 1e-6, 1.0, True, tf.constant(0.5), None):
        assert not dropout_draw._exact_rate(rate), rate
    exact, widened = _spy(monkeypatch), _spy(monkeypatch, "float32_draw")
    x = np.ones((8, 1 << 16), "float32")

    def run():
        layer = keras.layers.Dropout(1e-6, seed=2)  # below 2**-16: the 16-bit threshold would be 0
        _compiled(layer, x)
        return layer(tf.cast(x, layer.compute_dtype), training=True)

    y = _under_tfmp("mixed_bfloat16", run)
    assert (len(exact), len(widened)) == (0, 1) and y.dtype == tf.bfloat16
