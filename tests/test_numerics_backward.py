"""tfmp.check_numerics names the layer whose backward pass made a gradient non-finite, and loss terms.

The culprit layers here are finite forward and NaN only in the gradient with
respect to their input: the Euclidean norm of a zero vector, spelled
``sqrt(sum(v ** 2))``, has the value 0 and the derivative 2v * 1 / (2 sqrt(0)) =
0 * inf = NaN (``tf.norm`` itself has a finite gradient at 0 from TensorFlow 2.23). Their own weights (if any) get finite gradients, so
the first weights with a NaN gradient are those of the layer below; the report
must name the culprit. Expected gradients are computed independently with a
plain `tf.GradientTape` over the same layers, without tfmp's hooks.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from _xla import assert_same_step_results, not_under_xla
from tfmp._src.keras_hooks import loss_terms, surfaces

BATCH = 8


class NormShift(keras.layers.Layer):
    """x + |x - x| row-wise: the value is x, the gradient w.r.t. x is NaN (d|v|/dv at v = 0)."""

    def call(self, x):
        return x + tf.sqrt(tf.reduce_sum(tf.square(x - x), axis=-1, keepdims=True))


class ScaledNormShift(NormShift):
    """`NormShift` times a trainable scalar, whose own gradient stays finite."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return super().call(x) * keras.ops.cast(self.scale, x.dtype)


def _data(steps=1, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.uniform(1.0, 2.0, (steps * BATCH, 4)).astype("float32")
    y = rng.uniform(0.0, 1.0, (steps * BATCH, 2)).astype("float32")
    return x, y


def _functional(culprit=NormShift, seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="d1")(inputs)
    hidden = culprit(name="culprit")(hidden)
    hidden = keras.layers.Dense(8, activation="relu", name="d2")(hidden)
    outputs = keras.layers.Dense(2, name="out", dtype="float32")(hidden)
    return keras.Model(inputs, outputs, name="net")


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.d1 = keras.layers.Dense(8, name="d1")
        self.culprit = ScaledNormShift(name="culprit")
        self.d2 = keras.layers.Dense(2, name="d2")

    def call(self, x):
        return self.d2(self.culprit(self.d1(x)))


def _optimizer():
    """Adam under tfmp's optimizer; its scale starts at its floor, so a NaN gradient counts at once."""
    return tfmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=1.0, min_scale=1.0,
                                   guard="gradients")


def _boundary_gradients(model, layers, x, y):
    """max |dL/d(output)| and max |dL/d(input)| of `layers[1]` and the NaN weights, by a plain tape.

    `layers` is the model's chain of layers, called one after another.
    """
    with tf.GradientTape() as tape:
        h_in = layers[0](x)
        tape.watch(h_in)
        h_out = layers[1](h_in)
        tape.watch(h_out)
        pred = h_out
        for layer in layers[2:]:
            pred = layer(pred)
        loss = keras.losses.MeanSquaredError()(y, tf.cast(pred, "float32"))
    d_out, d_in, *d_weights = tape.gradient(loss, [h_out, h_in] + model.trainable_variables)
    as_max = lambda g: float(tf.reduce_max(tf.abs(tf.cast(g, tf.float32))))  # noqa: E731
    nan_weights = sorted(v.path for v, g in zip(model.trainable_variables, d_weights)
                         if not np.isfinite(as_max(g)))
    return as_max(d_out), as_max(d_in), nan_weights


def _state(model):
    """The weights and Adam's variables (its iteration count and every slot), as numpy."""
    return [v.numpy().copy() for v in model.weights + model.optimizer.inner_optimizer.variables]


@pytest.fixture
def policy_restored():
    before = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(before)


#: The premise of `NormShift`'s NaN (the kind, the messages saying "nan"), which XLA does not keep.
NORM_GRAD_NAN = ("NormShift's NaN input gradient is TensorFlow's Sqrt and Square gradient kernels at a zero "
                 "row (0 * inf); XLA rewrites that gradient, so the kind and the messages differ")
#: The premise of sqrt(relu(0))'s NaN gradient, which XLA does not keep.
RELU_GRAD_NAN = ("the NaN gradient is TensorFlow's ReluGrad kernel multiplying inf by 0 at relu(0); "
                 "XLA's ReluGrad is a select that passes 0 there, so every gradient stays finite")


@not_under_xla(NORM_GRAD_NAN)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_functional_culprit_nan_only_in_dx_is_named_and_nothing_is_applied(policy, policy_restored):
    keras.config.set_dtype_policy(policy)
    model = _functional()
    model.compile(_optimizer(), "mse")
    x, y = _data()
    model.build((None, 4))
    layers = [model.get_layer(name) for name in ("d1", "culprit", "d2", "out")]
    d_out, d_in, nan_weights = _boundary_gradients(model, layers, x, y)
    # Independently: the culprit's output gradient is finite, its input gradient NaN,
    # and the first weights with a NaN gradient are d1's, the layer below it.
    assert np.isfinite(d_out) and d_out > 0 and np.isnan(d_in)
    assert nan_weights == ["net/d1/bias", "net/d1/kernel"] or nan_weights == ["d1/bias", "d1/kernel"]
    model.optimizer.build(model.trainable_variables)
    before = _state(model)
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(x, y, batch_size=BATCH, verbose=0)
    error = info.value
    assert (error.layer, error.phase, error.step, error.kind) == ("culprit", "backward", 0, "nan")
    assert error.details["layer_class"] == "NormShift" and error.details["dtype"] == policy.split("_")[1]
    assert error.details["output_gradient"] == pytest.approx(d_out, rel=2e-2)  # the loss scale is 1
    assert np.isnan(error.details["input_gradient"]) and error.details["weight_gradient"] == 0.0
    assert error.details["bad_gradients"] == 2  # d1's kernel and bias
    message = str(error)
    assert message.startswith("The backward pass of layer 'culprit' (NormShift) turned a finite gradient "
                              "into nan at train step 0")
    assert "the gradient it passed to its inputs nan." in message
    assert [item["layer"] for item in error.details["trace"]] == ["d1", "culprit", "d2", "out", "loss"]
    after = _state(model)
    assert len(after) == len(before)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # weights, Adam's slots: untouched
    assert int(model.optimizer.overflow_count.numpy()) == 1  # the guard skipped the step


@not_under_xla(NORM_GRAD_NAN)
def test_subclassed_culprit_with_finite_weight_gradients_is_named():
    model = Subclassed()
    x, y = _data()
    model(x[:1])
    model.compile(_optimizer(), "mse")
    d_out, d_in, nan_weights = _boundary_gradients(model, [model.d1, model.culprit, model.d2], x, y)
    assert np.isfinite(d_out) and np.isnan(d_in)
    assert not any("culprit" in path for path in nan_weights) and any("d1" in path for path in nan_weights)
    model.optimizer.build(model.trainable_variables)
    before = _state(model)
    handle = tfmp.check_numerics(model, phase="backward")
    assert [layer.name for layer in handle.layers] == ["d1", "culprit", "d2"]
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(x, y, batch_size=BATCH, verbose=0)
    error = info.value
    assert (error.layer, error.phase, error.kind) == ("culprit", "backward", "nan")
    assert error.details["layer_class"] == "ScaledNormShift"
    assert np.isfinite(error.details["weight_gradient"]) and error.details["weight_gradient"] > 0
    assert "to its inputs nan, to its weights finite" in str(error)
    assert all(np.array_equal(a, b) for a, b in zip(before, _state(model)))


def test_healthy_model_raises_nothing_and_the_probes_change_no_value():
    x, y = _data(steps=4)
    results = []
    for phase in (None, "backward", "both"):
        model = _functional(culprit=lambda name: keras.layers.Lambda(lambda t: tf.sqrt(tf.abs(t) + 1.0),
                                                                       name=name))
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        handle = tfmp.check_numerics(model, phase=phase) if phase else None
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, epochs=2)
        results.append((history.history["loss"], [w.numpy() for w in model.weights]))
        if handle is not None:
            assert handle.failures == []
            handle.remove()
    (plain_loss, plain_weights), *hooked = results
    for loss, weights in hooked:
        assert_same_step_results(plain_loss, plain_weights, loss, weights)


@not_under_xla(RELU_GRAD_NAN)
def test_a_gradient_non_finite_from_the_loss_names_the_loss_backward_pass():
    """sqrt(relu(p - p)) is 0 forward; its derivative is inf * 0 = NaN for every prediction."""
    model = _functional(culprit=lambda name: keras.layers.Dense(8, name=name))

    def loss(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_true - y_pred)) + tf.reduce_mean(tf.sqrt(tf.nn.relu(y_pred - y_pred)))

    model.compile("sgd", loss)
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(*_data(), batch_size=BATCH, verbose=0)
    error = info.value
    assert (error.layer, error.phase, error.kind) == ("out", "backward", "nan")
    assert "The gradient reaching the output of layer 'out' (Dense) is already nan" in str(error)
    assert "the loss function's backward pass produced it" in str(error)
    assert np.isnan(error.details["output_gradient"])


def test_float16_backward_culprit_counts_only_at_the_scale_floor(policy_restored):
    """Above the floor the NaN is skipped as an overflow (scale halves); at the floor it is named."""
    keras.config.set_dtype_policy("mixed_float16")
    model = _functional()
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=4.0, min_scale=1.0,
                                        guard="gradients", max_consecutive_overflows=10)
    model.compile(optimizer, "mse")
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(*_data(steps=4), batch_size=BATCH, verbose=0)
    # Steps 0 and 1 at scales 4 and 2 are skipped; at scale 1 the NaN is real.
    assert (info.value.layer, info.value.phase, info.value.step) == ("culprit", "backward", 2)
    assert info.value.details["loss_scale"] == 1.0 and "floor" in str(info.value)


# -- loss terms -------------------------------------------------------------------


class AddsNaN(keras.layers.Layer):
    """Adds sqrt(-(mean x^2) - 1), NaN for any x, as a loss term; returns x."""

    def call(self, x):
        self.add_loss(tf.sqrt(-tf.reduce_mean(tf.square(tf.cast(x, "float32"))) - 1.0))
        return x


def _term_model(**dense_kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="reg", **dense_kwargs)(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden), name="terms")


def test_an_overflowing_weight_regularizer_is_named_with_its_variable_and_factor():
    model = _term_model(kernel_initializer="ones", kernel_regularizer=keras.regularizers.L2(1e38))
    model.compile("sgd", "mse")
    # Independently: 1e38 * sum(1**2 over 4x4) = 1.6e39, past float32's largest value.
    assert 1e38 * 16.0 > float(np.finfo(np.float32).max)
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(*_data(), batch_size=BATCH, verbose=0)
    error = info.value
    assert (error.layer, error.phase, error.step, error.kind) == ("reg", "loss", 0, "inf")
    assert error.details["loss_term"] == "weight_regularizer"
    assert error.details["variable"].endswith("reg/kernel") and error.details["regularizer"] == "L2(l2=1e+38)"
    message = str(error)
    assert message.startswith("The loss term of regularizer L2(l2=1e+38) on variable ")
    assert "of layer 'reg' (Dense) is inf at train step 0" in message
    assert "not the loss function" in message and "lower the regularizer's factor" in message
    assert "the loss function produced it" not in message


def test_an_add_loss_term_that_is_nan_names_its_layer():
    inputs = keras.Input((4,))
    hidden = AddsNaN(name="kl")(keras.layers.Dense(4, name="d1")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))
    model.compile("sgd", "mse")
    with np.errstate(invalid="ignore"):
        assert np.isnan(np.sqrt(np.float32(-1.0)))  # the term's value for any input
    tfmp.check_numerics(model, phase="backward")  # terms are checked in every phase
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(*_data(), batch_size=BATCH, verbose=0)
    error = info.value
    assert (error.layer, error.phase, error.kind, error.details["loss_term"]) == ("kl", "loss", "nan", "add_loss")
    assert str(error).startswith("The loss term layer 'kl' (AddsNaN) adds with add_loss is nan at train step 0")
    assert "compute it in float32" in str(error)


def test_an_activity_regularizer_term_is_named_and_an_unchecked_layer_says_it_cannot_tell():
    model = _term_model(activity_regularizer=keras.regularizers.L2(1e38), kernel_initializer="ones")
    model.compile("sgd", "mse")
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(*_data(), batch_size=BATCH, verbose=0)
    error = info.value
    assert (error.layer, error.phase, error.kind) == ("reg", "loss", "inf")
    assert error.details["loss_term"] == "activity_regularizer"
    assert "The loss term of layer 'reg' (Dense)'s activity regularizer L2(l2=1e+38) is inf" in str(error)
    model = _term_model(activity_regularizer=keras.regularizers.L2(1e38), kernel_initializer="ones")
    model.compile("sgd", "mse")
    tfmp.check_numerics(model, layers=["out"])  # "reg" not checked: add_loss or regularizer
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(*_data(), batch_size=BATCH, verbose=0)
    assert info.value.details["loss_term"] == "add_loss_or_activity_regularizer"
    assert info.value.layer == "reg"


def test_a_non_finite_loss_function_with_finite_terms_still_names_the_loss_function():
    model = _term_model(kernel_regularizer=keras.regularizers.L2(1e-3))
    model.compile("sgd", loss=lambda y_true, y_pred: tf.reduce_mean(tf.math.log(y_pred * 0.0)))
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(*_data(), batch_size=BATCH, verbose=0)
    error = info.value
    assert (error.layer, error.phase, error.kind) == (None, "loss", "inf")
    assert "the loss function produced it" in str(error)
    trace = error.details["trace"]
    assert [item["term"].kind for item in trace if item["term"] is not None] == ["weight_regularizer"]
    # The watch on Layer.losses was on only while the step was traced.
    assert all(hook.owner != "numerics" for hook in surfaces.process_wide())


def test_term_sources_follow_keras_order_of_model_losses():
    """The contract row: Layer.losses = own terms, each sublayer's own terms, then weight regularizers."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="a", activity_regularizer=keras.regularizers.L1(0.5),
                                kernel_regularizer=keras.regularizers.L2(0.25))(inputs)
    hidden = AddsNaN(name="kl")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, name="b", bias_regularizer=keras.regularizers.L2(2.0))(hidden))
    x = tf.constant(_data()[0])
    model(x)
    sources = loss_terms.term_sources(model)
    terms = model.losses
    assert [(origin, getattr(owner, "name", None)) for origin, owner, _ in sources] == [
        ("own", "a"), ("own", "kl"), ("weight", None), ("weight", None)]
    assert [variable.path for origin, _, variable in sources if origin == "weight"] == ["a/kernel", "b/bias"]
    # Each term's value, computed independently in float64.
    a, b = model.get_layer("a"), model.get_layer("b")
    # Keras divides an activity term by the batch size since 3.13 (3.12 adds the sum as it is).
    per_example = tuple(int(n) for n in keras.__version__.split(".")[:2]) >= (3, 13)
    activity = 0.5 * np.abs(a(x).numpy().astype(np.float64)).sum() / (BATCH if per_example else 1)
    kernel = 0.25 * np.square(a.kernel.numpy().astype(np.float64)).sum()
    bias = 2.0 * np.square(b.bias.numpy().astype(np.float64)).sum()
    values = [float(t) for t in terms]
    assert values[0] == pytest.approx(activity, rel=1e-5) and np.isnan(values[1])
    assert values[2:] == [pytest.approx(kernel, rel=1e-5), pytest.approx(bias, rel=1e-5)]
    assert [t is raw for t, (_, _, raw) in zip(terms[:2], sources[:2])] == [True, True]
