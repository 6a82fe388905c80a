"""What tfmp.LossScaleOptimizer checks before a step, and the unscaled-loss warning.

Part 1: a custom `train_step` that never calls `scale_loss` (the Keras guide's,
under mixed_float16) warns once per optimizer; every flow that scales does not.
Part 2: without loss scaling the default guard skips a step with a non-finite
loss, a non-finite batch or a non-finite gradient born in the backward pass
alone; `guard="loss"` checks the loss only and lets that gradient through.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 8)).astype("float32")
Y = (3.0 * (X.sum(axis=1, keepdims=True) > 0)).astype("float32")


class GuideModel(keras.Model):
    """The Keras guide's custom train_step; `scale` adds the one line it lacks."""

    def __init__(self, *args, scale=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            if self.scale:
                loss = self.optimizer.scale_loss(loss)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def _model(cls=keras.Model, **kwargs):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, "relu", kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
    outputs = keras.layers.Dense(1, dtype="float32", kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
    return cls(inputs, outputs, **kwargs)


def _loss_warnings(record):
    return [w for w in record if issubclass(w.category, tfmp.LossScaleWarning)]


def _fit_20_sgd_steps(policy, cls=keras.Model, **kwargs):
    """Full-batch SGD, 20 steps in two fits; returns (final mse, LossScaleWarnings)."""
    with tfmp.policy_scope(policy), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = _model(cls, **kwargs)
        model.compile(keras.optimizers.SGD(0.05), "mse")
        model.fit(X, Y, batch_size=64, epochs=10, verbose=0)
        model.fit(X, Y, batch_size=64, epochs=10, verbose=0)
    mse = float(np.mean((model.predict(X, verbose=0) - Y) ** 2))
    return mse, _loss_warnings(record), model


# Part 1: the unscaled loss -------------------------------------------------------------


def test_guide_train_step_warns_once_and_the_fix_trains_like_float32():
    reference, silent, _ = _fit_20_sgd_steps("float32", GuideModel)
    stalled, warned, model = _fit_20_sgd_steps("mixed_float16", GuideModel)
    fixed, quiet, _ = _fit_20_sgd_steps("mixed_float16", GuideModel, scale=True)
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
    assert (len(silent), len(warned), len(quiet)) == (0, 1, 0)  # once over 20 steps, 2 fits
    message = str(warned[0].message)
    assert "32768x too small" in message and "as Keras's LossScaleOptimizer does" in message
    assert "scaled_loss = self.optimizer.scale_loss(loss)" in message and "tfmp.scaled_gradients" in message
    assert warned[0].filename == __file__  # said at the user's fit(), not inside tfmp or Keras
    # From an mse of 2.260 at the start, 20 steps reach 0.717 in float32 and with
    # the fix under mixed_float16; unscaled, each update is 2**15 times too small
    # (as under Keras's own LossScaleOptimizer) and the loss stays at 2.260.
    assert reference == pytest.approx(0.717, abs=0.005)
    assert fixed == pytest.approx(reference, rel=1e-3)
    assert stalled == pytest.approx(2.260, abs=0.005)


def test_warning_can_be_made_an_error():
    with tfmp.policy_scope("mixed_float16"), warnings.catch_warnings():
        warnings.simplefilter("error", tfmp.LossScaleWarning)
        model = _model(GuideModel)
        model.compile(keras.optimizers.SGD(0.05), "mse")
        with pytest.raises(tfmp.LossScaleWarning, match="scale_loss"):
            model.fit(X, Y, batch_size=64, epochs=1, verbose=0)


def _custom_loop(flow, optimizer, steps=3):
    layer = keras.layers.Dense(1)
    layer.build((None, 8))
    variables = layer.trainable_variables

    def loss_of():
        return tf.reduce_mean(tf.square(layer(X) - Y))

    @tf.function
    def scaled_grads():
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(loss_of())
        return tape.gradient(loss, variables)

    @tf.function
    def apply(grads):
        optimizer.apply(grads, variables)

    for _ in range(steps):
        if flow == "scaled_gradients":
            with tf.GradientTape() as tape:
                loss = loss_of()
            optimizer.apply(tfmp.scaled_gradients(tape, loss, variables, optimizer), variables)
        elif flow == "tf_keras_2":
            with tf.GradientTape() as tape:
                scaled = optimizer.get_scaled_loss(loss_of())
            grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, variables))
            optimizer.apply_gradients(zip(grads, variables))
        elif flow == "two_functions":  # scaled in one tf.function, applied in another
            apply(scaled_grads())
        else:  # "unscaled": the bug
            with tf.GradientTape() as tape:
                loss = loss_of()
            optimizer.apply(tape.gradient(loss, variables), variables)
    return layer


@pytest.mark.parametrize(
    "flow, loss_scaling, expected",
    [
        ("scaled_gradients", True, 0),
        ("tf_keras_2", True, 0),
        ("two_functions", True, 0),
        ("unscaled", True, 1),
        ("unscaled", False, 0),  # scale fixed at 1: nothing to warn about
    ],
)
def test_custom_loops_warn_only_when_no_loss_was_scaled(flow, loss_scaling, expected):
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**4, loss_scaling=loss_scaling)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _custom_loop(flow, optimizer)
    assert len(_loss_warnings(record)) == expected
    assert int(optimizer.total_steps.numpy()) == 3 and int(optimizer.overflow_count.numpy()) == 0


@pytest.mark.parametrize("accumulation", [None, 2])
def test_compile_and_fit_do_not_warn(accumulation):
    with tfmp.policy_scope("mixed_float16"), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = _model()
        model.compile(keras.optimizers.SGD(0.05, gradient_accumulation_steps=accumulation), "mse")
        model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    assert _loss_warnings(record) == []
    assert int(model.optimizer.total_steps.numpy()) == 8
    assert int(model.optimizer.iterations.numpy()) == 8 // (accumulation or 1)


# Part 2: the guard without loss scaling ------------------------------------------------


@tf.custom_gradient
def _inf_gradient(x):
    """Identity forward (finite loss); the gradient flowing back is inf."""
    return x, lambda dy: dy * float("inf")


def _guard_model(gradient_bomb=False):
    layers = [keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")]
    if gradient_bomb:
        layers.append(keras.layers.Lambda(_inf_gradient))
    return keras.Sequential(layers)


def _fit_one_batch(model, x):
    kernel = model.get_weights()[0].copy()
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=len(x), verbose=0)
    return kernel, model.get_weights()[0]


def test_bfloat16_default_skips_a_nan_loss_batch():
    with tfmp.policy_scope("mixed_bfloat16"):
        model = _guard_model()
        model.compile(keras.optimizers.SGD(0.1), "mse")
    optimizer = model.optimizer
    assert (optimizer.loss_scaling, optimizer.guard) == (False, "auto")
    with pytest.warns(tfmp.SkippedStepWarning, match="The batch itself holds nan"):
        before, after = _fit_one_batch(model, np.array([[1.0, np.nan], [1.0, 1.0]], "float32"))
    np.testing.assert_array_equal(after, before)
    assert [int(getattr(optimizer, n).numpy()) for n in ("overflow_count", "total_steps")] == [1, 1]
    assert int(optimizer.last_loss_status.numpy()) == 1 + 4  # NaN in the loss and in the batch
    before, after = _fit_one_batch(model, np.ones((2, 2), "float32"))
    assert not np.array_equal(after, before) and np.isfinite(after).all()
    assert [int(getattr(optimizer, n).numpy()) for n in ("overflow_count", "total_steps")] == [1, 2]


def test_the_batch_record_is_in_the_train_function_keras_makes_once():
    """The ``"batch"`` guard's hook goes on ``train_step`` before Keras makes the train
    function (which binds the step), so ``fit`` never makes it a second time."""
    with tfmp.policy_scope("mixed_bfloat16"):
        model = _guard_model()
        model.compile(keras.optimizers.SGD(0.1), "mse")
    keras_make = model.make_train_function
    made = []

    def counted(force=False):
        made.append(force)
        return keras_make(force)

    model.make_train_function = counted  # the instance's, below tfmp's own hooks
    with pytest.warns(tfmp.SkippedStepWarning, match="The batch itself holds nan"):
        before, after = _fit_one_batch(model, np.array([[1.0, 1.0], [np.nan, 1.0]], "float32"))
    np.testing.assert_array_equal(after, before)
    assert made == [False]


@pytest.mark.parametrize(
    "options, caught",
    [
        ({}, True),  # the default guard reads every gradient
        ({"loss_scale_options": {"guard": "loss"}}, False),  # the loss is finite: let through
        ({"loss_scale_options": {"guard": "gradients"}}, True),
        ({"debug": {"action": "warn", "phase": "forward"}}, True),
    ],
    ids=["default", "guard=loss", "guard=gradients", "debug"],
)
def test_inf_gradient_with_finite_loss(options, caught):
    with tfmp.policy_scope("mixed_bfloat16", **options):
        model = _guard_model(gradient_bomb=True)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    optimizer = model.optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.SkippedStepWarning)
        before, after = _fit_one_batch(model, np.ones((2, 2), "float32"))
    assert int(optimizer.last_loss_status.numpy()) == 0  # finite loss
    assert int(optimizer.overflow_count.numpy()) == (1 if caught else 0)
    if caught:
        np.testing.assert_array_equal(after, before)
    else:
        assert not np.isfinite(after).any()


@tf.custom_gradient
def _sqrt_of_square(x):
    """|x| as sqrt(x**2): the forward pass is finite, the gradient at x = 0 is 0 * inf = NaN.

    What a norm or a ``sqrt`` at 0 does in real models; only the gradient with
    respect to the input turns NaN, never the layer's own weights.
    """
    y = tf.sqrt(tf.square(x))
    return y, lambda dy: dy * x / y


class SqrtOfSquare(keras.layers.Layer):
    def call(self, x):
        return _sqrt_of_square(x)


def _backward_nan_model():
    init = keras.initializers.GlorotUniform
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, kernel_initializer=init(seed=1))(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.Dense(8, kernel_initializer=init(seed=2))(hidden)
    hidden = SqrtOfSquare()(hidden)
    outputs = keras.layers.Dense(1, kernel_initializer=init(seed=3))(hidden)
    return keras.Model(inputs, outputs)


def _state(model):
    """Copies of the weights (BatchNormalization's statistics among them) and the optimizer's variables."""
    return ([np.array(v.numpy(), copy=True) for v in model.weights],
            [np.array(v.numpy(), copy=True) for v in model.optimizer.inner_optimizer.variables])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32", "mixed_float16"])
def test_a_nan_born_in_the_backward_pass_never_reaches_the_weights_under_the_default_guard(policy):
    """A finite batch and a finite loss, a NaN gradient below the sqrt: skipped, counted and said.

    The first fit (healthy batches: no zero at the sqrt) moves every weight; the
    second batch makes the sqrt's input exactly 0 for one example (its Dense
    kernel is zeroed, bias 0), so the backward pass alone turns NaN.
    """
    rng = np.random.default_rng(7)  # its own data, whatever ran before (the module's RNG is shared)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    # float32: enable() leaves the optimizer alone unless asked; float16: a scale low
    # enough that no healthy step overflows, so the one skip is the NaN's.
    options = {"float32": {"loss_scale_options": {"guard": "auto"}},
               "mixed_float16": {"loss_scale_options": {"initial_scale": 16.0}}}.get(policy, {})
    with tfmp.policy_scope(policy, **options):
        model = _backward_nan_model()
        model.compile(keras.optimizers.Adam(0.01), "mse")
    optimizer = model.optimizer
    assert isinstance(optimizer, tfmp.LossScaleOptimizer) and optimizer.guard == "auto"
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert int(optimizer.overflow_count.numpy()) == 0
    dense = model.layers[3]
    dense.kernel.assign(np.zeros(dense.kernel.shape, "float32"))
    dense.bias.assign(np.zeros(dense.bias.shape, "float32"))
    weights, slots = _state(model)
    scale = optimizer.loss_scale
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    said = [str(w.message) for w in record if issubclass(w.category, tfmp.SkippedStepWarning)]
    if optimizer.loss_scaling:  # indistinguishable from an overflow: the scale halves, stuck detection follows
        assert said == []
    else:
        assert len(said) == 1 and "skipped step 2" in said[0]
        # said at the user's fit(), not inside tfmp or Keras
        assert [w.filename for w in record if issubclass(w.category, tfmp.SkippedStepWarning)] == [__file__]
        assert "a gradient is not: an inf or NaN born in the backward pass" in said[0]
    after_weights, after_slots = _state(model)
    for before, after in zip(weights + slots, after_weights + after_slots):
        np.testing.assert_array_equal(after, before)  # weights, statistics, slots, iterations
    assert [int(getattr(optimizer, n).numpy()) for n in ("overflow_count", "total_steps")] == [1, 3]
    assert int(optimizer.last_overflow_status.numpy()) == 0  # neither the batch nor the loss
    if optimizer.loss_scaling:
        assert optimizer.loss_scale == scale / 2
    # Plain Keras under the same policy writes the step (NaN in the weights below the
    # sqrt), but under float16, where its own LossScaleOptimizer skips it too.
    keras.config.set_dtype_policy(policy)
    try:
        plain = _backward_nan_model()
    finally:
        keras.config.set_dtype_policy("float32")
    plain.compile(keras.optimizers.Adam(0.01), "mse")
    plain.set_weights(model.get_weights())
    plain.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not isinstance(plain.optimizer, tfmp.LossScaleOptimizer)
    for layer in plain.layers[1:4]:
        finite = np.isfinite(layer.weights[0].numpy()).all()
        assert finite == (policy == "mixed_float16"), layer.name


@pytest.mark.parametrize("compiled", [False, True])
def test_custom_loop_with_scale_loss_checks_the_loss_and_without_it_the_gradients(compiled):
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), loss_scaling=False)
    variable = keras.Variable([1.0])
    optimizer.build([variable])

    def step(loss_factor, grad_factor, scale):
        with tf.GradientTape() as tape:
            loss = _inf_gradient(variable * grad_factor)[0] * loss_factor
            if scale:
                loss = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(loss, [variable]), [variable])

    run = tf.function(step) if compiled else step
    run(1.0, 1.0, True)  # finite loss, inf gradient: the default guard reads the gradients
    np.testing.assert_array_equal(variable.numpy(), [1.0])
    run(float("nan"), 1.0, True)  # NaN loss: skipped
    run(1.0, 1.0, False)  # no scale_loss in the step: the gradients are checked
    np.testing.assert_array_equal(variable.numpy(), [1.0])
    assert [int(getattr(optimizer, n).numpy()) for n in ("overflow_count", "total_steps")] == [3, 3]
    loss_only = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), loss_scaling=False, guard="loss")
    optimizer = loss_only
    loss_only.build([variable])
    run = tf.function(step) if compiled else step
    run(1.0, 1.0, True)  # the "loss" guard reads the loss only: the inf gradient goes through
    assert not np.isfinite(variable.numpy()).any()
    variable.assign([1.0])
    run(1.0, 1.0, False)  # without scale_loss, the gradients are checked under every guard
    np.testing.assert_array_equal(variable.numpy(), [1.0])


def test_guard_arguments_are_checked():
    sgd = keras.optimizers.SGD()
    with pytest.raises(ValueError, match=r"Invalid `guard`.*Did you mean 'gradients'"):
        tfmp.LossScaleOptimizer(sgd, guard="gradient", loss_scaling=False)
    with pytest.raises(ValueError, match="loss_scaling=False"):
        tfmp.LossScaleOptimizer(sgd, guard="loss")
    with pytest.raises(ValueError, match="Invalid `guard`"):
        tfmp.enable("mixed_float16", loss_scale_options={"guard": "loss"})
    assert not tfmp._src.policy.enable.is_enabled()
    with tfmp.policy_scope("mixed_bfloat16", loss_scale_options={"guard": "loss"}):
        model = _guard_model()
        model.compile("sgd", "mse")
    assert model.optimizer.guard == "loss"
    with tfmp.policy_scope("mixed_bfloat16", debug=True):
        model = _guard_model()
        model.compile("sgd", "mse")
    assert model.optimizer.guard == "gradients"
