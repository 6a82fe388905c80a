"""Optimizers a custom `compile` keeps (`tfmp._src.loss_scale.custom_optimizers`).

The keras.io DCGAN pattern, written as keras.io writes it (tiny Dense models):
``compile(d_optimizer, g_optimizer, loss_fn)`` calls ``super().compile()`` and
stores both optimizers, and ``train_step`` applies their gradients without
loss scaling.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tfmp
from tfmp import DeviceFacts, GpuFacts

LATENT = 4
FEATURES = 8
BATCH = 4
FIX = "tfmp.scaled_gradients(tape, loss, variables, self.{name})"


#: Devices on which each policy is fast, so `enable` gives no PerformanceWarning.
DEVICES = {
    "mixed_float16": DeviceFacts(gpus=(GpuFacts("Tesla V100", (7, 0)),)),
    "mixed_bfloat16": DeviceFacts(gpus=(GpuFacts("NVIDIA A100", (8, 0)),)),
    "float32": DeviceFacts(),
}


@pytest.fixture(autouse=True)
def always_disable():
    yield
    tfmp.disable()


def enable(policy):
    return tfmp.enable(policy=policy, device_facts=DEVICES[policy])


class GAN(keras.Model):
    """keras.io's DCGAN ``GAN`` model, as written there (tf.GradientTape, no loss scaling)."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        labels = ops.concatenate(
            [ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0
        )
        labels += 0.05 * tf.random.uniform(tf.shape(labels))

        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights)
        )

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {
            "d_loss": self.d_loss_metric.result(),
            "g_loss": self.g_loss_metric.result(),
        }


def gan(d_learning_rate=0.0001):
    discriminator = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(4), keras.layers.LeakyReLU(negative_slope=0.2),
         keras.layers.Dense(1, activation="sigmoid")],
        name="discriminator",
    )
    generator = keras.Sequential(
        [keras.Input((LATENT,)), keras.layers.Dense(FEATURES)], name="generator"
    )
    model = GAN(discriminator=discriminator, generator=generator, latent_dim=LATENT)
    model.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=d_learning_rate),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
        loss_fn=keras.losses.BinaryCrossentropy(),
    )
    return model


def images(poison=False):
    x = np.random.default_rng(0).normal(size=(BATCH, FEATURES)).astype("float32")
    if poison:
        x[0, 0] = np.inf
    return tf.data.Dataset.from_tensor_slices(x).batch(BATCH)


def loss_scale_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, tfmp.LossScaleWarning)]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_dcgan_optimizers_are_wrapped_and_warned_about_once(policy):
    enable(policy)
    model = gan()
    for name in ("d_optimizer", "g_optimizer"):
        optimizer = getattr(model, name)
        assert isinstance(optimizer, tfmp.LossScaleOptimizer), name
        assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
        assert optimizer.loss_scaling is (policy == "mixed_float16")
        assert int(optimizer.overflow_count.numpy() if optimizer.built else 0) == 0
    assert tfmp.attachment(model).custom_optimizers == ["d_optimizer", "g_optimizer"]
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        model.fit(images(), epochs=1, verbose=0, shuffle=False)
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        model.fit(images(), epochs=1, verbose=0, shuffle=False)
    texts = loss_scale_warnings(first)
    if policy == "mixed_float16":  # bfloat16 keeps float32's range: nothing flushes to zero
        assert len(texts) == 2
        for name in ("d_optimizer", "g_optimizer"):
            (text,) = [t for t in texts if f"`{name}` of model 'gan' applies gradients of a loss that was not scaled" in t]
            assert "not scaled" in text and "6e-8" in text and FIX.format(name=name) in text
    else:
        assert texts == []
    assert loss_scale_warnings(second) == []
    for name in ("d_optimizer", "g_optimizer"):
        optimizer = getattr(model, name)
        assert int(optimizer.overflow_count.numpy()) == 0
        assert int(optimizer.total_steps.numpy()) == 2
        assert int(optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.filterwarnings("ignore::tfmp.LossScaleWarning")
def test_dcgan_step_with_an_inf_in_the_batch_is_skipped_and_counted(policy):
    enable(policy)
    model = gan()
    model.fit(images(), epochs=1, verbose=0, shuffle=False)
    before = [w.numpy() for w in model.discriminator.weights]
    model.fit(images(poison=True), epochs=1, verbose=0, shuffle=False)
    after = [w.numpy() for w in model.discriminator.weights]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # bit-identical
    assert int(model.d_optimizer.overflow_count.numpy()) == 1
    assert int(model.d_optimizer.total_steps.numpy()) == 2
    assert int(model.d_optimizer.inner_optimizer.iterations.numpy()) == 1
    assert int(model.g_optimizer.overflow_count.numpy()) == 0  # the generator's step never sees the batch


def test_user_set_learning_rate_reads_and_writes_through():
    enable("mixed_bfloat16")
    model = gan(d_learning_rate=0.0003)
    assert float(model.d_optimizer.learning_rate) == pytest.approx(0.0003)
    model.d_optimizer.learning_rate = 0.5
    model.fit(images(), epochs=1, verbose=0, shuffle=False)
    assert float(model.d_optimizer.learning_rate) == 0.5
    assert float(model.d_optimizer.inner_optimizer.learning_rate) == 0.5
    assert float(model.g_optimizer.learning_rate) == pytest.approx(0.0001)


class OneWeight(keras.Model):
    """A custom compile storing `d_optimizer`; the loss is `factor * w * x`, x = 1."""

    def __init__(self, factor, scaled):
        super().__init__()
        self.dense = keras.layers.Dense(
            1, use_bias=False, kernel_initializer=keras.initializers.Constant(2.0**-10)
        )
        self.dense.build((None, 1))
        self.factor, self.scaled = factor, scaled

    def compile(self, d_optimizer):
        super().compile()
        self.d_optimizer = d_optimizer

    def call(self, x):
        return self.dense(x)

    def train_step(self, x):
        variables = self.dense.trainable_weights
        with tf.GradientTape() as tape:
            loss = self.factor * ops.sum(ops.cast(self.dense(x), "float32"))
        if self.scaled:
            grads = tfmp.scaled_gradients(tape, loss, variables, self.d_optimizer)
        else:
            grads = tape.gradient(loss, variables)
        self.d_optimizer.apply_gradients(zip(grads, variables))
        return {"loss": loss}


# Expected kernel after one SGD(learning_rate=1) step from w = 2**-10: w - dloss/dw,
# dloss/dw = factor (x = 1). Under float16 the gradient flows back through the
# float16 layer: 2**-30 flushes to zero unless multiplied by the scale 2**15
# first (2**-15 is a float16 subnormal, exact); bfloat16 holds 2**-30.
@pytest.mark.parametrize("policy, factor, scaled, expected", [
    ("mixed_float16", 2.0**-30, True, 2.0**-10 - 2.0**-30),  # scaled, divided back by 2**15
    ("mixed_float16", 2.0**-30, False, 2.0**-10),  # unscaled: flushed to zero (the warning's point)
    ("mixed_float16", 2.0**-4, False, 2.0**-10 - 2.0**-4),  # unscaled: applied as given, not / 2**15
    ("mixed_bfloat16", 2.0**-30, False, 2.0**-10 - 2.0**-30),
    ("mixed_bfloat16", 2.0**-30, True, 2.0**-10 - 2.0**-30),
])
def test_gradients_reach_the_weight_with_the_right_magnitude(policy, factor, scaled, expected):
    enable(policy)
    model = OneWeight(factor, scaled)
    model.compile(d_optimizer=keras.optimizers.SGD(learning_rate=1.0))
    assert model.dense.compute_dtype == policy.split("_")[1]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ones = tf.data.Dataset.from_tensors(np.ones((1, 1), "float32"))
        model.fit(ones, epochs=1, verbose=0, shuffle=False)
    assert model.dense.kernel.numpy().item() == expected
    texts = loss_scale_warnings(record)
    assert len(texts) == (1 if policy == "mixed_float16" and not scaled else 0)
    if policy == "mixed_float16":
        assert model.d_optimizer.loss_scale == 2.0**15
        assert int(model.d_optimizer.overflow_count.numpy()) == 0


def test_an_optimizer_also_passed_as_optimizer_shares_the_one_wrapper():
    class Shared(keras.Model):
        def compile(self, d_optimizer):
            super().compile(optimizer=d_optimizer)
            self.d_optimizer = d_optimizer

        def call(self, x):
            return x

    enable("mixed_float16")
    model = Shared()
    model.compile(d_optimizer=keras.optimizers.SGD())
    assert model.d_optimizer is model.optimizer
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)


def test_optimizers_set_before_super_compile_or_after_it_are_wrapped_and_lists_warned_about():
    class Early(keras.Model):
        def compile(self, d_optimizer, pair):
            self.d_optimizer = d_optimizer
            super().compile()
            self.d_again = d_optimizer
            self.pair = pair

        def call(self, x):
            return x

    enable("mixed_float16")
    model = Early()
    with pytest.warns(tfmp.LossScaleWarning, match=r"(?s)plain optimizers in `pair`.*wrap each in tfmp.LossScaleOptimizer"):
        model.compile(d_optimizer=keras.optimizers.SGD(), pair=[keras.optimizers.SGD()])
    assert isinstance(model.d_optimizer, tfmp.LossScaleOptimizer)
    assert model.d_again is model.d_optimizer  # one wrapper, one scale
    model.late = keras.optimizers.Adam()  # stored after compile: wrapped too
    assert isinstance(model.late, tfmp.LossScaleOptimizer)
    assert tfmp.attachment(model).custom_optimizers == ["d_optimizer", "d_again", "late"]
    tfmp.detach(model)
    model.later = keras.optimizers.Adam()
    assert not isinstance(model.later, tfmp.LossScaleOptimizer)  # detached: the hook is off


def test_a_float32_model_keeps_its_custom_optimizers():
    enable("float32")
    model = OneWeight(1.0, scaled=False)
    optimizer = keras.optimizers.SGD()
    model.compile(d_optimizer=optimizer)
    assert model.d_optimizer is optimizer


def test_fit_stops_when_a_custom_optimizer_keeps_skipping_steps():
    tfmp.enable(policy="mixed_bfloat16", device_facts=DEVICES["mixed_bfloat16"],
                loss_scale_options={"max_consecutive_overflows": 2})
    model = gan()
    with pytest.raises(tfmp.NonFiniteError, match="2 non-finite steps in a row"):
        model.fit(images(poison=True).repeat(3), epochs=1, verbose=0, shuffle=False)
    assert int(model.d_optimizer.overflow_count.numpy()) == 2
