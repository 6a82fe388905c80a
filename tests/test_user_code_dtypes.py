"""User code written for 16 bits trains under tfmp: loss terms, float token ids, dtype errors.

1. A loss term a layer adds with ``add_loss`` from its 16-bit tensors (the Keras
   VAE example's KL term) is summed in float32 with the compiled loss and the
   weight regularizers: the loss Keras reports is the float32 sum of the terms.
2. Token ids declared as a float ``keras.Input`` reach an ``Embedding`` inside a
   custom layer exactly, although the custom layer autocasts them to 16 bits.
3. A layer mixing a float32 tensor it created with its 16-bit inputs fails with
   the same exception type and text, plus the layer's path, both dtypes and the
   remedies; so does a layer whose ``tf.custom_gradient`` gradient function mixes a
   float32 tensor with the 16-bit upstream gradient (backward pass), in ``fit`` and
   in a custom training loop.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _collect import collect_until

import tfmp

POLICIES = ("mixed_bfloat16", "mixed_float16")
ORIGINAL_LOSSES = keras.layers.Layer.__dict__["losses"]


def _losses_hook_gone():
    tfmp.disable()
    return keras.layers.Layer.__dict__["losses"] is ORIGINAL_LOSSES


@pytest.fixture(autouse=True)
def always_disable():
    yield
    tfmp.disable()
    collect_until(_losses_hook_gone)  # the test's models are gone: nothing keeps the losses hook
    assert keras.layers.Layer.__dict__["losses"] is ORIGINAL_LOSSES


def _quiet_enable(policy, **options):
    """`tfmp.enable` without its 'slower than float32 here' warning (CPU without 16-bit units)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        return tfmp.enable(policy, **options)


def _kl(z_mean, z_log_var):
    return -0.5 * tf.reduce_mean(1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var))


class KLSampling(keras.layers.Layer):
    """The Keras VAE example's sampling layer; adds its KL term in the compute dtype."""

    def call(self, inputs, training=None):
        z_mean, z_log_var = inputs
        self.add_loss(_kl(z_mean, z_log_var))
        if not training:
            return z_mean
        eps = keras.random.normal(tf.shape(z_mean), dtype=self.compute_dtype, seed=1)
        return z_mean + tf.exp(0.5 * z_log_var) * eps


def _vae(l2=0.01):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="enc")(inputs)
    z_mean = keras.layers.Dense(2, name="z_mean", kernel_regularizer=keras.regularizers.L2(l2))(hidden)
    z_log_var = keras.layers.Dense(2, name="z_log_var")(hidden)
    z = KLSampling(name="sampling")([z_mean, z_log_var])
    decoded = keras.layers.Dense(8, name="dec")(keras.layers.Dense(16, activation="relu")(z))
    model = keras.Model(inputs, decoded)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model, keras.Model(inputs, [z_mean, z_log_var, decoded])


X = np.random.default_rng(0).uniform(0.0, 1.0, (24, 8)).astype("float32")


def test_plain_keras_mixed_precision_fails_on_a_16bit_add_loss_term():
    keras.config.set_dtype_policy("mixed_bfloat16")  # the fixture restores it
    model, _ = _vae()
    with pytest.raises(TypeError, match="dtype <dtype: 'bfloat16'> to <dtype: 'float32'>"):
        model.fit(X, X, batch_size=8, verbose=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_vae_with_16bit_kl_term_trains_with_finite_loss(policy):
    _quiet_enable(policy)
    model, _ = _vae()
    history = model.fit(X, X, batch_size=8, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3
    assert np.isfinite(history.history["loss"][0])


class _ReadsLosses(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.count = len(self.model.losses)


@pytest.mark.parametrize("policy", POLICIES)
def test_model_losses_stay_readable_after_fit_as_in_plain_keras(policy):
    _quiet_enable(policy)
    model, _ = _vae()
    reads = _ReadsLosses()
    model.fit(X, X, batch_size=8, verbose=0, callbacks=[reads])
    # After the trace, the terms are the finished graph's tensors: handed back as
    # Keras holds them (16-bit add_loss term, float32 regularizer), not cast.
    assert reads.count == 2
    assert [t.dtype for t in model.losses] == [policy.split("_")[1], "float32"]


@pytest.mark.parametrize("policy", POLICIES)
def test_reported_loss_is_the_float32_sum_of_every_term(policy):
    _quiet_enable(policy)
    model, probe = _vae(l2=0.5)
    z_mean, z_log_var, decoded = probe(X, training=False)
    assert z_mean.dtype == policy.split("_")[1] and decoded.dtype == "float32"
    kl = float(tf.cast(_kl(z_mean, z_log_var), tf.float32))
    mse = float(np.mean((X - decoded.numpy()) ** 2))
    kernel = model.get_layer("z_mean").kernel.numpy()
    l2 = float(0.5 * np.sum(kernel.astype(np.float64) ** 2))
    assert l2 > 0.1 and abs(kl) > 1e-3  # each term weighs in the total
    terms = model.losses
    assert [t.dtype for t in terms] == ["float32", "float32"]  # add_loss term cast, regularizer as is
    reported = model.evaluate(X, X, batch_size=len(X), verbose=0)
    assert reported == pytest.approx(mse + kl + l2, rel=1e-5)
    # Without the KL term: compiled loss + L2 exactly (the regularizer stays float32).
    assert float(terms[1]) == pytest.approx(l2, rel=1e-6)


def test_losses_hook_is_installed_only_while_enabled():
    assert keras.layers.Layer.__dict__["losses"] is ORIGINAL_LOSSES
    _quiet_enable("mixed_bfloat16")
    assert keras.layers.Layer.__dict__["losses"] is not ORIGINAL_LOSSES
    tfmp.disable()
    assert keras.layers.Layer.__dict__["losses"] is ORIGINAL_LOSSES



# 2. Float token ids ----------------------------------------------------------------


class Tokens(keras.layers.Layer):
    """A custom layer around an Embedding: its __call__ autocasts float ids to 16 bits."""

    def __init__(self, vocab, **kwargs):
        super().__init__(**kwargs)
        self.vocab = vocab
        self.embedding = keras.layers.Embedding(vocab, 4, name="embedding")
        self.seen = []

    def call(self, ids):
        self.seen.append(keras.backend.standardize_dtype(ids.dtype))
        return self.embedding(ids)


def _id_model(vocab, length):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(length,))  # float32 ids, as many tutorials declare them
    tokens = Tokens(vocab, name="tokens")
    pooled = keras.layers.GlobalAveragePooling1D()(tokens(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(pooled))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model, tokens


@pytest.mark.parametrize(
    "policy, vocab, ids",
    [("mixed_bfloat16", 2000, [1001, 1999]), ("mixed_float16", 5000, [4097, 4999])],
)
def test_float_ids_reach_the_embedding_exactly(policy, vocab, ids):
    compute = policy.split("_")[1]
    assert float(np.asarray(ids[0], compute)) != ids[0]  # the 16-bit autocast would round them
    _quiet_enable(policy)
    model, tokens = _id_model(vocab, len(ids))
    x = np.array([ids], "float32")
    rows = tokens(x)[0]
    table = tokens.embedding.embeddings
    expected = keras.ops.cast(keras.ops.take(table, np.array(ids), axis=0), compute)
    assert rows.dtype == compute
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(rows), keras.ops.convert_to_numpy(expected))
    assert tokens.seen[-1] == compute  # the custom layer's code still sees 16 bits, as under Keras
    before = table.numpy().copy()
    history = model.fit(np.repeat(x, 4, axis=0), np.ones((4, 1), "float32"), batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    changed = np.flatnonzero(np.any(table.numpy() != before, axis=1))
    assert changed.tolist() == sorted(ids)  # gradients reached exactly the rows looked up
    assert tokens.get_config()["dtype"]["config"]["name"] == policy



def test_float_ids_into_a_subclassed_model_with_an_embedding():
    class Classifier(keras.Model):
        def __init__(self):
            super().__init__()
            self.embedding = keras.layers.Embedding(2000, 4, name="embedding")
            self.pool = keras.layers.GlobalAveragePooling1D()

        def call(self, ids):
            return self.pool(self.embedding(ids))

    _quiet_enable("mixed_bfloat16")
    model = Classifier()
    model.compile("sgd", "mse")
    out = model(np.array([[1999, 1999]], "float32"))
    expected = keras.ops.cast(model.embedding.embeddings[1999], "bfloat16")
    assert out.dtype == "float32"  # the model's outputs are float32 under tfmp
    np.testing.assert_array_equal(out.numpy()[0], keras.ops.cast(expected, "float32").numpy())


def test_plain_keras_rounds_float_ids_past_the_vocabulary():
    keras.config.set_dtype_policy("mixed_bfloat16")  # the fixture restores it
    _, tokens = _id_model(2000, 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"= 2000 is not in \[0, 2000\)"):
        tokens(np.array([[1001, 1999]], "float32"))


# 3. Dtype errors that say what to do ------------------------------------------------

REMEDY = ("dtype=self.compute_dtype", "keep_float32=['block/noise']", "tf.cast(t, x.dtype)")


class Noise(keras.layers.Layer):
    """Multiplies its input by float32 noise it creates: fails under any mixed policy."""

    def call(self, x):
        return x * tf.random.uniform(tf.shape(x))


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, name="dense")
        self.noise = Noise(name="noise")

    def call(self, x):
        return self.noise(self.dense(x))


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = Block(name="block")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x):
        return self.out(self.block(x))


def _original(error):
    return error.__cause__ or error.__context__


def _text(error):
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


@pytest.mark.parametrize("policy", POLICIES)
def test_fit_error_names_layer_dtypes_and_remedies(policy):
    _quiet_enable(policy)
    model = Net()
    model.compile("sgd", "mse")
    with pytest.raises(TypeError) as info:
        model.fit(np.ones((4, 8), "float32"), np.ones((4, 1), "float32"), verbose=0)
    text = _text(info.value)
    assert "Input 'y' of 'Mul' Op has type float32 that does not match type" in text  # TF's text kept
    assert f"Layer 'block/noise' (Noise) mixes {policy.split('_')[1]} and float32 tensors" in text
    assert all(remedy in text for remedy in REMEDY)
    # Same type; the original is chained (Keras's traceback filter re-raises `from None`,
    # which hides __cause__ from the printout but keeps __context__).
    assert type(info.value) is TypeError and type(_original(info.value)) is TypeError
    assert "tfmp:" not in str(_original(info.value))


def test_eager_call_keeps_tensorflow_error_type():
    _quiet_enable("mixed_bfloat16")
    model = Net()
    model.compile("sgd", "mse")
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        model(np.ones((2, 8), "float32"))
    text = _text(info.value)
    assert "Layer 'block/noise' (Noise) mixes bfloat16 and float32 tensors" in text
    assert all(remedy in text for remedy in REMEDY)
    assert type(info.value) is type(_original(info.value))
    assert info.value.op is _original(info.value).op


def test_lambda_in_sequential_predict_is_named():
    _quiet_enable("mixed_bfloat16")
    model = keras.Sequential(
        [keras.layers.Dense(4), keras.layers.Lambda(lambda x: x + tf.constant(1.0), name="shift"), keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse")
    with pytest.raises(TypeError) as info:
        model.predict(np.ones((2, 3), "float32"), verbose=0)
    text = _text(info.value)
    assert "Layer 'shift' (Lambda) mixes bfloat16 and float32 tensors" in text
    assert "keep_float32=['shift']" in text and "tf.cast(t, x.dtype)" in text


def test_other_errors_pass_unchanged():
    _quiet_enable("mixed_bfloat16")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    with pytest.raises(ValueError) as info:
        model.fit(np.ones((2, 4), "float32"), np.ones((2, 1)), verbose=0)  # wrong input width
    assert "expected shape" in str(info.value) and "tfmp:" not in _text(info.value)


def test_mismatch_texts_are_recognised():
    from tfmp._src.float32.dtype_errors import mismatched_dtypes

    assert mismatched_dtypes("cannot compute Mul as input #1(zero-based) was expected to be a half tensor but is a float tensor") == ("float16", "float32")
    assert mismatched_dtypes("Tensor conversion requested dtype bfloat16 for Tensor with dtype float32") == ("bfloat16", "float32")
    assert mismatched_dtypes("has type int32 that does not match type float32") is None


# Backward-pass dtype errors (float32/gradient_errors.py) ------------------------------

BACKWARD_FIX = ("ops.cast(self.kernel, dy.dtype)", "return gradients in their inputs' dtypes",
                "keep_float32=['block/scaled']", "#a-gradient-function-mixes-16-bit-and-float32-tensors")


class Scaled(keras.layers.Layer):
    """x @ kernel with its own gradient; `bad` picks how the gradient function goes wrong.

    ``"kernel"`` reads the float32 kernel variable directly (as ``self.kernel``),
    ``"constant"`` multiplies by a float32 ``tf.constant`` without naming the layer,
    ``None`` casts everything to ``dy.dtype`` (works).
    """

    def __init__(self, bad=None, **kwargs):
        super().__init__(**kwargs)
        self.bad = bad

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 4), name="kernel")

    def call(self, x):
        # Not `self` in the gradient function: TensorFlow's gradient registry keeps
        # each traced gradient function, and with it the layer, for good.
        bad, variable = self.bad, self.kernel

        @tf.custom_gradient
        def matmul(x, kernel):
            def grad(dy):
                if bad == "kernel":
                    return tf.matmul(dy, variable, transpose_b=True), tf.matmul(x, dy, transpose_a=True)
                if bad == "constant":
                    return tf.matmul(dy, kernel, transpose_b=True) * tf.constant(1.0), tf.matmul(x, dy, transpose_a=True)
                return tf.matmul(dy, kernel, transpose_b=True), tf.matmul(x, dy, transpose_a=True)

            return tf.matmul(x, kernel), grad

        return matmul(x, keras.ops.cast(self.kernel, x.dtype))


class ScaledBlock(keras.layers.Layer):
    def __init__(self, bad=None, **kwargs):
        super().__init__(**kwargs)
        self.scaled = Scaled(bad, name="scaled")

    def call(self, x):
        return self.scaled(x)


def _scaled_model(bad):
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, name="dense"),
                             ScaledBlock(bad, name="block"), keras.layers.Dense(1, name="out")])


_X, _Y = np.ones((2, 3), "float32"), np.ones((2, 1), "float32")


@pytest.mark.parametrize("policy, bad", [("mixed_float16", "kernel"), ("mixed_float16", "constant"),
                                         ("mixed_bfloat16", "constant")])
def test_backward_error_in_fit_names_layer_dtypes_and_fix(policy, bad):
    _quiet_enable(policy)
    model = _scaled_model(bad)
    model.compile("sgd", "mse")
    with pytest.raises(TypeError) as info:  # raised while Keras traces the train step
        model.fit(_X, _Y, verbose=0)
    text, low = _text(info.value), policy.split("_")[1]
    assert "that does not match type" in text  # TF's text kept
    assert f"The backward pass of layer 'block/scaled' (Scaled) mixes {low} and float32 tensors" in text
    assert all(fix in text for fix in BACKWARD_FIX)
    assert text.count("tfmp:") == 1
    # Same type; the original is chained (Keras's traceback filter re-raises `from None`,
    # which clears __cause__ and keeps __context__).
    original = _original(info.value)
    assert type(info.value) is TypeError and type(original) is TypeError
    assert "tfmp:" not in str(original) and str(original) in str(info.value)


def test_a_float32_gradient_returned_under_bfloat16_is_named_where_it_arrives():
    """tf.matmul(bfloat16 dy, float32 self.kernel) gives float32: the Dense below fails."""
    _quiet_enable("mixed_bfloat16")
    model = _scaled_model("kernel")
    model.compile("sgd", "mse")
    with pytest.raises(TypeError) as info:
        model.fit(_X, _Y, verbose=0)
    text = _text(info.value)
    assert "layer 'dense' (Dense) received a float32 gradient for its bfloat16 output" in text
    assert "A layer after it returns its gradient in the wrong dtype" in text
    assert "ops.cast(self.kernel, dy.dtype)" in text and text.count("tfmp:") == 1


def test_backward_error_in_a_custom_training_loop_keeps_the_type_and_cause():
    _quiet_enable("mixed_float16")
    model = _scaled_model("kernel")
    model.compile("sgd", "mse")  # compiled while enabled: attached; trained by hand
    with pytest.raises(tf.errors.InvalidArgumentError) as info:  # eager: TF's eager-op text
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(_X, training=True), "float32") - _Y))
        tape.gradient(loss, model.trainable_variables)
    assert "The backward pass of layer 'block/scaled' (Scaled) mixes float16 and float32" in _text(info.value)
    assert type(info.value.__cause__) is tf.errors.InvalidArgumentError
    assert info.value.op is info.value.__cause__.op and "tfmp:" not in str(info.value.__cause__)


def test_output_gradients_of_the_wrong_dtype_are_named_as_a_cause():
    """A model's output is float32 under tfmp; a bfloat16 output gradient fed to
    tape.gradient makes the Dense's backward matmul mix dtypes."""
    _quiet_enable("mixed_bfloat16")
    inputs = keras.Input((4,))
    dense = keras.layers.Dense(3)
    model = keras.Model(inputs, dense(inputs))
    model.compile("sgd", "mse")

    @tf.function
    def step(x, dy):
        with tf.GradientTape() as tape:
            y = model(x, training=True)
        return tape.gradient(y, dense.kernel, output_gradients=dy)

    with pytest.raises(TypeError) as info:
        step(tf.ones((2, 4)), tf.ones((2, 3), tf.bfloat16))
    text = _text(info.value)
    assert "The output_gradients given to tape.gradient are bfloat16 for a float32 output." in text
    assert "Fix: give each output gradient the dtype of the output it belongs to" in text


def test_working_custom_gradient_layer_trains_unchanged():
    # A small initial scale: at Keras's 2**15 a gradient above 2 overflows float16 and
    # both steps of this random-weight model may be skipped (nothing to compare).
    _quiet_enable("mixed_float16", loss_scale_options={"initial_scale": 2.0**4})
    keras.utils.set_random_seed(0)
    model = _scaled_model(None)
    model.compile("sgd", "mse")
    kernel = model.get_layer("block").scaled.kernel
    before = kernel.numpy()
    history = model.fit(_X, _Y, verbose=0, epochs=2)
    assert np.isfinite(history.history["loss"]).all()
    assert int(model.optimizer.overflow_count.numpy()) == 0
    assert not np.array_equal(before, kernel.numpy())  # its gradient reached the kernel


def test_other_backward_errors_and_models_tfmp_does_not_explain_pass_unchanged():
    _quiet_enable("mixed_bfloat16")
    x = tf.Variable(1.0)

    @tf.custom_gradient
    def broken(v):
        def grad(dy):
            raise ValueError("broken on purpose")

        return v * 1.0, grad

    with tf.GradientTape() as tape:
        y = broken(x)
    with pytest.raises(ValueError) as info:
        tape.gradient(y, x)
    assert str(info.value) == "broken on purpose" and info.value.__cause__ is None
    tfmp.disable()
    keras.config.set_dtype_policy("mixed_float16")  # restored by the conftest fixture
    plain = _scaled_model("kernel")  # compiled without tfmp: Keras's own mixed policy
    plain.compile("sgd", "mse")
    with pytest.raises(TypeError) as info:
        plain.fit(_X, _Y, verbose=0)
    assert "tfmp:" not in _text(info.value)


class ReadsSelf(keras.layers.Layer):
    """Its gradient function reads the float32 ``self.kernel`` (called eagerly only:
    a traced one would stay in TensorFlow's gradient registry, holding the layer)."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 4), name="kernel")

    def call(self, x):
        @tf.custom_gradient
        def matmul(x, kernel):
            def grad(dy):
                return tf.matmul(dy, self.kernel, transpose_b=True), tf.matmul(x, dy, transpose_a=True)

            return tf.matmul(x, kernel), grad

        return matmul(x, keras.ops.cast(self.kernel, x.dtype))


def test_the_layer_a_gradient_function_holds_is_named_among_layers_of_its_class():
    _quiet_enable("mixed_float16")
    model = keras.Sequential([keras.Input((3,)), ReadsSelf(name="first"), ReadsSelf(name="second"),
                              keras.layers.Dense(1, name="out")])
    model.compile("sgd", "mse")
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.cast(model(_X, training=True), "float32"))
        tape.gradient(loss, model.trainable_variables)
    assert "The backward pass of layer 'second' (ReadsSelf) mixes float16 and float32" in _text(info.value)
    tfmp.detach(model)  # TensorFlow keeps the layers of a failed eager custom gradient alive (without tfmp too)
