"""Never silent: a bad batch never reaches the weights, the optimizer slots or the statistics.

Each fault is injected into a tiny model (a few steps; float16 steps are slow on
some CPUs) and the outcome asserted exactly: weights and slots bit-identical,
BatchNormalization statistics unchanged, counters and status bits, the warning.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tfmp
from tfmp._src.float32 import fused_batchnorm
from tfmp._src.loss_scale.optimizer import STATUS_BITS

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
ROWS, FEATURES = 16, 8


@keras.saving.register_keras_serializable(package="tfmp_tests")
def _hide_nan(z):
    """ReLU written so that NaN becomes 0 on every CPU (oneDNN's relu does so on some)."""
    return ops.where(z > 0, z, 0.0)


@tf.custom_gradient
def _inf_gradient(x):
    """Identity forward (finite loss); the gradient flowing back is inf."""
    return x, lambda dy: dy * float("inf")


def _model(policy, *, batch_norm=False, gradient_bomb=False, guard=None, learning_rate=1e-2,
           optimizer="adam", initial_scale=None):
    """MLP 8-32-4 under `policy`, compiled while tfmp is enabled; float32 gets a tfmp optimizer too."""
    options = {"loss_scale_options": {"guard": guard}} if guard else {}
    if initial_scale:
        options = {"loss_scale_options": {"initial_scale": initial_scale}}
    if policy == "float32" and not guard:
        options = {"loss_scale_options": {"guard": "auto"}}  # under float32 only asked-for options wrap
    tfmp.enable(policy=policy, **options)
    try:
        keras.utils.set_random_seed(0)
        layers = [keras.Input((FEATURES,)), keras.layers.Dense(32), keras.layers.Activation(_hide_nan)]
        if batch_norm:
            layers.append(keras.layers.BatchNormalization())
        if gradient_bomb:
            layers.append(keras.layers.Lambda(_inf_gradient))
        layers.append(keras.layers.Dense(4))
        model = keras.Sequential(layers)
        inner = (keras.optimizers.Adam if optimizer == "adam" else keras.optimizers.SGD)(learning_rate)
        model.compile(inner, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finally:
        tfmp.disable()
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(ROWS, FEATURES)).astype("float32"), rng.integers(0, 4, ROWS)


def _state(model):
    """Copies of every model variable (BatchNormalization statistics too) and optimizer variable."""
    inner = model.optimizer.inner_optimizer
    return ([v.numpy().copy() for v in model.variables], [v.numpy().copy() for v in inner.variables])


def _assert_same(before, after):
    for kept, now in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(now, kept)


def _fit(model, x, y, **kwargs):
    return model.fit(x, y, batch_size=ROWS, verbose=0, shuffle=False, **kwargs)


def _counters(model):
    optimizer = model.optimizer
    return [int(v.numpy()) for v in (optimizer.overflow_count, optimizer.total_steps, optimizer.last_loss_status)]


@pytest.mark.parametrize("policy", POLICIES)
def test_one_nan_input_the_forward_pass_hides_is_skipped(policy):
    model = _model(policy)
    x, y = _data()
    _fit(model, x, y)  # builds the slots
    before = _state(model)
    x[3, 2] = np.nan
    with pytest.warns(tfmp.SkippedStepWarning) as record:
        history = _fit(model, x, y)
    if policy != "mixed_float16":  # "batch" guard: the loss stays finite, the batch is caught
        assert np.isfinite(history.history["loss"][0])
        assert "The batch itself holds nan" in str(record[0].message)
        assert _counters(model) == [1, 2, STATUS_BITS["batch nan"]]
    else:  # mixed_float16 checks every gradient: the first layer's is NaN
        assert _counters(model)[:2] == [1, 2]
    assert len([w for w in record if w.category is tfmp.SkippedStepWarning]) == 1
    _assert_same(before, _state(model))
    x, y = _data(1)
    _fit(model, x, y)  # the next clean batch is applied
    assert _counters(model)[:2] == [1, 3]


@pytest.mark.parametrize("policy", ("float32", "mixed_bfloat16"))
def test_every_input_nan_skips_every_step_and_warns_once(policy):
    model = _model(policy)
    x, y = _data()
    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.warns(tfmp.SkippedStepWarning) as record:
        _fit(model, np.full_like(np.tile(x, (4, 1)), np.nan), np.tile(y, 4))
    assert len([w for w in record if w.category is tfmp.SkippedStepWarning]) == 1
    assert "skipped step 0 (1 of 1 steps since step 0" in str(record[0].message)
    assert _counters(model)[:2] == [4, 4]
    for kept, variable in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(variable.numpy(), kept)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_skipped_step_keeps_batchnorm_statistics(policy):
    model = _model(policy, batch_norm=True)
    x, y = _data()
    _fit(model, x, y)
    before = _state(model)
    x[5, 1] = np.inf
    with pytest.warns(tfmp.SkippedStepWarning):
        _fit(model, x, y)
    _assert_same(before, _state(model))
    assert _counters(model)[:2] == [1, 2]
    assert np.isfinite(model.predict(x[:4] * 0, verbose=0)).all()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_gradient_overflow_skip_puts_the_statistics_back(policy):
    """The forward pass is finite and moves the statistics; the skip must undo that."""
    model = _model(policy, batch_norm=True, gradient_bomb=True, guard="gradients")
    bn = next(layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization))
    x, y = _data()
    statistics = [bn.moving_mean.numpy().copy(), bn.moving_variance.numpy().copy()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.SkippedStepWarning)
        _fit(model, x, y)
    assert _counters(model)[:2] == [1, 1]
    np.testing.assert_array_equal(bn.moving_mean.numpy(), statistics[0])
    np.testing.assert_array_equal(bn.moving_variance.numpy(), statistics[1])


def test_batchnorm_of_a_model_tfmp_did_not_attach_is_keras_s():
    """Invisible: a plain Keras model's statistics follow Keras, NaN included."""
    model = keras.Sequential([keras.Input((4, 4, 2)), keras.layers.BatchNormalization()])
    x = np.ones((2, 4, 4, 2), "float32")
    x[0, 0, 0, 0] = np.nan
    model(x, training=True)
    assert np.isnan(model.layers[0].moving_mean.numpy()[0])


def test_fused_batchnorm_statistics_survive_an_inf_batch():
    """The fused kernel's path (4D input, mixed policy, attached) keeps finite statistics too."""
    with tfmp.policy_scope("mixed_bfloat16"):
        model = keras.Sequential([keras.Input((4, 4, 2)), keras.layers.BatchNormalization()])
        x = np.ones((2, 4, 4, 2), "float32")
        model(x, training=True)
        bn = model.layers[0]
        before = [bn.moving_mean.numpy().copy(), bn.moving_variance.numpy().copy()]
        x[0, 0, 0, 0] = np.inf
        model(x, training=True)
    assert fused_batchnorm.last_call_reason(bn) == ""  # the fused kernel ran
    np.testing.assert_array_equal(bn.moving_mean.numpy(), before[0])
    np.testing.assert_array_equal(bn.moving_variance.numpy(), before[1])


@pytest.mark.parametrize("policy", ("float32", "mixed_bfloat16"))
def test_values_guard_skips_a_learning_rate_that_blows_the_weights_up(policy):
    model = _model(policy, guard="values", learning_rate=1e38, optimizer="sgd")
    x, y = _data()
    x *= 100.0  # gradients above 3.4: 1e38 * gradient overflows float32
    before = _state(model)
    with pytest.warns(tfmp.SkippedStepWarning, match="would have written a non-finite value"):
        _fit(model, x, y)
    _assert_same(before, _state(model))
    assert _counters(model) == [1, 1, STATUS_BITS["values"]]
    model.optimizer.learning_rate = 1e-2
    _fit(model, x, y)
    assert _counters(model)[:2] == [1, 2]
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


def test_default_guard_says_at_once_when_a_learning_rate_ruined_the_weights():
    """The default guard writes the first huge step, then says why every later one is skipped."""
    model = _model("mixed_bfloat16", learning_rate=1e38, optimizer="sgd")
    x, y = _data()
    with pytest.warns(tfmp.SkippedStepWarning, match="The loss itself is non-finite"):
        _fit(model, np.tile(x, (3, 1)), np.tile(y, 3))
    assert _counters(model)[0] >= 1


def test_a_fit_of_only_skipped_steps_is_said_before_stuck_detection():
    """Issue 25, fault 4: a float16 logsumexp overflows every step; 12 skips < 32 must not be silent."""
    tfmp.enable(policy="mixed_float16")
    try:
        inputs = keras.Input((64,))
        logits = keras.layers.Dense(64, kernel_initializer="ones")(inputs)
        lse = keras.layers.Lambda(lambda z: ops.expand_dims(ops.log(ops.sum(ops.exp(z), -1)), -1))(logits)
        model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(lse))
        model.compile(keras.optimizers.SGD(1e-3), "mse")
    finally:
        tfmp.disable()
    x = np.full((12 * 4, 64), 2.0, "float32")
    with pytest.warns(tfmp.SkippedStepWarning, match="The loss itself is non-finite") as record:
        model.fit(x, np.zeros((48, 1), "float32"), batch_size=4, verbose=0)
    assert len([w for w in record if w.category is tfmp.SkippedStepWarning]) == 1
    assert "skipped step 0 (1 of 1 steps since step 0" in str(record[0].message)
    assert [int(model.optimizer.overflow_count.numpy()), int(model.optimizer.total_steps.numpy())] == [12, 12]


def test_gradient_overflow_warns_when_the_first_steps_are_all_skipped():
    model = _model("mixed_float16", gradient_bomb=True)
    x, y = _data()
    with pytest.warns(tfmp.SkippedStepWarning, match="gradients overflow") as record:
        _fit(model, np.tile(x, (10, 1)), np.tile(y, 10))
    assert "(8 of 8 steps since step 0" in str(record[0].message)
    assert _counters(model)[:2] == [10, 10]


def test_the_descent_from_a_high_initial_scale_is_not_warned_about():
    """2**24 overflows this model's float16 gradients (about 0.1): the first steps halve it, as asked."""
    model = _model("mixed_float16", initial_scale=2.0**24)
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfmp.SkippedStepWarning)
        _fit(model, np.tile(x, (12, 1)), np.tile(y, 12))
    skipped, steps, _ = _counters(model)
    assert steps == 12 and skipped >= 4, "the test needs a descent of at least 4 skipped steps"
    assert model.optimizer.loss_scale > 2.0**15


def test_gradient_overflow_after_a_descent_from_a_high_initial_scale_is_warned_about():
    """The 9 halvings from 2**24 to Keras's default 2**15 are not counted; the 8 skips after them are."""
    model = _model("mixed_float16", gradient_bomb=True, initial_scale=2.0**24)
    x, y = _data()
    with pytest.warns(tfmp.SkippedStepWarning, match="gradients overflow") as record:
        _fit(model, np.tile(x, (20, 1)), np.tile(y, 20))
    assert len([w for w in record if w.category is tfmp.SkippedStepWarning]) == 1
    assert "skipped step 16 (8 of 8 steps since step 9; scale 128)" in str(record[0].message)
    assert _counters(model)[:2] == [20, 20]


@pytest.mark.parametrize("policy", POLICIES)
def test_healthy_training_says_nothing(policy):
    model = _model(policy, batch_norm=True)
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfmp.SkippedStepWarning)
        _fit(model, np.tile(x, (4, 1)), np.tile(y, 4), epochs=2)
    assert _counters(model)[0] == 0


def test_a_skip_inside_one_execution_of_several_steps_is_said():
    """steps_per_execution=2: a skipped step followed by a clean one in the same execution."""
    model = _model("mixed_bfloat16")
    model.compile(model.optimizer, model.loss, steps_per_execution=2)
    x, y = _data()
    x = np.tile(x, (2, 1))
    x[0, 0] = np.nan  # the first of the execution's two steps
    with pytest.warns(tfmp.SkippedStepWarning, match="The batch itself holds nan"):
        _fit(model, x, np.tile(y, 2))
    assert _counters(model)[:2] == [1, 2]


def test_a_batchnorm_layer_called_twice_in_a_skipped_step_gets_its_first_value_back():
    keras.utils.set_random_seed(0)
    tfmp.enable(policy="mixed_float16")
    try:
        inputs = keras.Input((FEATURES,))
        shared = keras.layers.BatchNormalization()
        hidden = shared(keras.layers.Dense(FEATURES)(inputs))
        outputs = keras.layers.Dense(4)(keras.layers.Lambda(_inf_gradient)(shared(hidden)))
        model = keras.Model(inputs, outputs)
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finally:
        tfmp.disable()
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.SkippedStepWarning)
        _fit(model, x * 10 + 3, y)
    assert _counters(model)[:2] == [1, 1]
    np.testing.assert_array_equal(shared.moving_mean.numpy(), np.zeros(FEATURES, "float32"))
    np.testing.assert_array_equal(shared.moving_variance.numpy(), np.ones(FEATURES, "float32"))


def test_a_skipped_step_never_puts_back_another_models_statistics():
    """Model A recalibrates its BatchNormalization eagerly; model B's skipped eager step leaves A's alone."""
    with tfmp.policy_scope("mixed_bfloat16"):
        a = keras.Sequential([keras.Input((FEATURES,)), keras.layers.BatchNormalization()])
        b = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4)])
        x, _ = _data()
        for _ in range(3):
            a(x + 5.0, training=True)
        calibrated = a.layers[0].moving_mean.numpy().copy()
        optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scaling=False)
        optimizer.build(b.trainable_variables)
        with tf.GradientTape() as tape:
            loss = ops.sum(b(x)) * float("nan")
        grads = tfmp.scaled_gradients(tape, loss, b.trainable_variables, optimizer)
        optimizer.apply(grads, b.trainable_variables)
    assert int(optimizer.overflow_count.numpy()) == 1
    np.testing.assert_array_equal(a.layers[0].moving_mean.numpy(), calibrated)
    assert not np.array_equal(calibrated, np.zeros(FEATURES, "float32"))


def test_values_guard_checks_the_optimizer_slots_too():
    """Adam's second moment overflows (gradient 2e20, finite) while the weights stay finite."""
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), loss_scaling=False, guard="values")
    optimizer.build([variable])
    with pytest.warns(tfmp.SkippedStepWarning, match="non-finite value"):
        optimizer.apply([tf.constant([2e20, 1.0])], [variable])
    assert [int(optimizer.overflow_count.numpy()), int(optimizer.inner_optimizer.iterations.numpy())] == [1, 0]
    np.testing.assert_array_equal(variable.numpy(), [1.0, 1.0])
    assert all(np.isfinite(v.numpy()).all() for v in optimizer.inner_optimizer.variables)


def test_values_guard_is_refused_under_a_distribution_strategy():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        variable = keras.Variable(np.ones(2, "float32"))
        optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scaling=False, guard="values")
        optimizer.build([variable])

    @tf.function
    def step():
        optimizer.apply([tf.ones(2)], [variable])

    with pytest.raises(ValueError, match="Invalid `guard` argument.*outside tf.distribute strategies"):
        strategy.run(step)


def test_a_model_that_masks_nan_inputs_itself_trains_as_under_plain_keras():
    """Invisible: NaN as a missing value, replaced by the model; the "batch" guard then checks the gradients."""

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        masked = keras.layers.Lambda(lambda t: ops.where(ops.isnan(t), 0.0, t))(inputs)
        return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(16, activation="relu")(masked)))

    x, y = _data()
    x[::2, 0] = np.nan
    losses = {}
    for name in ("keras", "tfmp"):
        if name == "tfmp":
            tfmp.enable(policy="mixed_bfloat16")
        else:
            keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            model = build()
            model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        finally:
            tfmp.disable() if name == "tfmp" else keras.config.set_dtype_policy("float32")
        with warnings.catch_warnings():
            warnings.simplefilter("error", tfmp.SkippedStepWarning)
            losses[name] = _fit(model, np.tile(x, (4, 1)), np.tile(y, 4), epochs=3).history["loss"]
        if name == "tfmp":
            assert _counters(model)[:2] == [0, 12]
    np.testing.assert_allclose(losses["tfmp"], losses["keras"], rtol=0.05)
    assert losses["tfmp"][-1] < losses["tfmp"][0]


def test_train_on_batch_warns_at_most_once_per_eight_steps():
    model = _model("mixed_bfloat16")
    x, y = _data()
    x[0, 0] = np.nan
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(16):
            model.train_on_batch(x, y)
    assert len([w for w in record if w.category is tfmp.SkippedStepWarning]) == 2
    assert _counters(model)[:2] == [16, 16]


@pytest.mark.parametrize("policy", ("mixed_bfloat16", "mixed_float16"))
def test_a_batchnorm_model_saves_and_loads_its_loss_scale_and_counters(policy, tmp_path):
    """The statistics a skipped step may put back are never optimizer variables."""
    model = _model(policy, batch_norm=True)
    x, y = _data()
    x[2, 0] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.SkippedStepWarning)
        _fit(model, x, y)
    assert not [v.path for v in model.optimizer.variables if "moving" in v.path]
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert _counters(loaded) == _counters(model) and _counters(model)[:2] == [1, 1]
    assert loaded.optimizer.loss_scale == model.optimizer.loss_scale


def test_enable_accepts_the_batch_guard_it_documents():
    tfmp.enable(policy="mixed_bfloat16", loss_scale_options={"guard": "batch"})
    tfmp.disable()
    with pytest.raises(ValueError, match="Invalid `guard` argument"):
        tfmp.enable(policy="mixed_float16", loss_scale_options={"guard": "batch"})


def test_a_custom_train_step_without_scale_loss_still_names_the_bad_batch():
    class CustomModel(keras.Model):  # as the keras.io guide writes it
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            return {"loss": loss}

    tfmp.enable(policy="mixed_bfloat16")
    try:
        inputs = keras.Input((FEATURES,))
        model = CustomModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(inputs)))
        model.compile(keras.optimizers.Adam(1e-2), "mse")
    finally:
        tfmp.disable()
    x, _ = _data()
    x[0, 0] = np.nan
    with pytest.warns(tfmp.SkippedStepWarning, match="The batch itself holds nan"):
        _fit(model, x, np.zeros((ROWS, 1), "float32"))
    assert _counters(model) == [1, 1, STATUS_BITS["batch nan"]]
