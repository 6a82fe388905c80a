"""tfmp.LossScaleOptimizer: exact scale sequences, counters, bounds, stuck detection.

Scales are powers of two so every value is exact. Keras's own loss-scale scenarios
(keras/src/optimizers/loss_scale_optimizer_test.py, stateful TF cases) are ported at
the end of the file and must hold for the subclass.
"""

import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.loss_scale import optimizer as _loss_scale

# These tests hand `apply` gradients they scaled themselves, without `scale_loss`.
pytestmark = pytest.mark.filterwarnings("ignore::tfmp.LossScaleWarning")

INF = float("inf")
FINITE = [1.0, 6.0, 7.0, 2.0]


def _optimizer(**kwargs):
    return tfmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5), **kwargs)


def _run(optimizer, grads, variable):
    """Applies each gradient in turn; returns the scale after each step."""
    scales = []
    for grad in grads:
        optimizer.apply([tf.constant(grad, tf.float32)], [variable])
        scales.append(optimizer.loss_scale)
    return scales


def _counter(optimizer, name):
    return int(getattr(optimizer, name).numpy())


# Exact sequences ("Done when", items 1, 2, 4) -------------------------------------


def test_backoff_sequence_from_400():
    optimizer = _optimizer(initial_scale=400.0)
    variable = keras.Variable([1.0, 2.0])
    assert _run(optimizer, [[INF, 1.0]] * 4, variable) == [200.0, 100.0, 50.0, 25.0]
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    assert _counter(optimizer, "overflow_count") == 4
    assert _counter(optimizer, "consecutive_overflows") == 4
    assert _counter(optimizer, "last_overflow_step") == 3


def test_growth_on_schedule():
    optimizer = _optimizer(initial_scale=2.0, dynamic_growth_steps=2)
    scales = _run(optimizer, [[1.0]] * 8, keras.Variable([0.0]))
    assert scales == [2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]


def test_min_scale_is_a_floor():
    optimizer = _optimizer(initial_scale=256.0, min_scale=32.0, on_stuck="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        scales = _run(optimizer, [[INF]] * 8, keras.Variable([0.0]))
    assert scales == [128.0, 64.0, 32.0, 32.0, 32.0, 32.0, 32.0, 32.0]


def test_max_scale_caps_growth():
    optimizer = _optimizer(initial_scale=4.0, dynamic_growth_steps=1, max_scale=24.0)
    assert _run(optimizer, [[1.0]] * 4, keras.Variable([0.0])) == [
        8.0,
        16.0,
        24.0,
        24.0,
    ]


def test_scale_never_inf_at_float32_limit():
    top = float(np.finfo(np.float32).max)
    optimizer = _optimizer(
        initial_scale=2.0**127, dynamic_growth_steps=1, max_scale=top
    )
    scales = _run(optimizer, [[1.0]] * 3, keras.Variable([0.0]))
    assert scales == [top] * 3 and math.isfinite(top)


def test_growth_counter_restarts_after_overflow():
    optimizer = _optimizer(initial_scale=8.0, dynamic_growth_steps=2)
    scales = _run(optimizer, [[1.0], [INF], [1.0], [1.0]], keras.Variable([0.0]))
    assert scales == [8.0, 4.0, 4.0, 8.0]
    assert _counter(optimizer, "consecutive_overflows") == 0


def test_hysteresis_backs_off_after_n_consecutive_overflows():
    optimizer = _optimizer(initial_scale=64.0, hysteresis=2)
    assert _run(optimizer, [[INF], [INF], [INF]], keras.Variable([0.0])) == [
        64.0,
        32.0,
        16.0,
    ]
    optimizer = _optimizer(initial_scale=64.0, hysteresis=2)
    assert _run(optimizer, [[INF], [1.0], [INF]], keras.Variable([0.0])) == [
        64.0,
        64.0,
        64.0,
    ]


def test_infs_at_steps_3_and_7_of_10_skip_exactly_those_steps():
    optimizer = _optimizer(initial_scale=2.0**10)
    variable = keras.Variable([4.0])
    changed = []
    for step in range(1, 11):
        before = variable.numpy().copy()
        grad = INF if step in (3, 7) else optimizer.loss_scale  # unscaled gradient 1.0
        optimizer.apply([tf.constant([grad])], [variable])
        changed.append(not np.array_equal(before, variable.numpy()))
    assert changed == [step not in (3, 7) for step in range(1, 11)]
    assert _counter(optimizer, "overflow_count") == 2
    assert _counter(optimizer, "last_overflow_step") == 6  # zero-based index of step 7
    assert _counter(optimizer, "total_steps") == 10
    assert int(optimizer.iterations.numpy()) == 8  # item 11: skipped steps do not count
    np.testing.assert_allclose(variable.numpy(), [4.0 - 8 * 0.5])


def test_variables_exist_with_documented_dtypes():
    optimizer = _optimizer()
    assert optimizer.loss_scale == 2.0**15  # before build
    optimizer.build([keras.Variable([0.0])])
    for name in (
        "overflow_count",
        "consecutive_overflows",
        "last_overflow_step",
        "total_steps",
    ):
        variable = getattr(optimizer, name)
        assert variable.dtype == "int64" and variable.shape == ()
        assert any(variable is v for v in optimizer.variables)
    assert optimizer.dynamic_scale.dtype == "float32"
    assert _counter(optimizer, "last_overflow_step") == -1


# Item 5: bfloat16 / float32 guard ---------------------------------------------------


def test_without_loss_scaling_scale_is_one_and_bad_steps_are_skipped():
    optimizer = _optimizer(loss_scaling=False, dynamic_growth_steps=1)
    variable = keras.Variable([1.0])
    assert float(optimizer.scale_loss(3.0)) == 3.0
    assert _run(optimizer, [[1.0], [float("nan")], [1.0], [1.0]], variable) == [1.0] * 4
    np.testing.assert_allclose(variable.numpy(), [1.0 - 3 * 0.5])
    assert _counter(optimizer, "overflow_count") == 1
    assert optimizer.get_config()["initial_scale"] == 2.0**15


def test_bfloat16_fit_survives_one_bad_batch():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")]
    )
    model.compile(_loss_scale.wrap_optimizer("sgd", "bfloat16"), "mse")
    x = np.ones((8, 2), "float32")
    x[4, 0] = np.nan  # third batch of 2
    seen = []  # item 11: callbacks read the counters after every step
    read = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(
            _counter(model.optimizer, "overflow_count")
        )
    )
    model.fit(
        x, np.zeros((8, 1)), batch_size=2, shuffle=False, verbose=0, callbacks=[read]
    )
    assert seen == [0, 0, 1, 1]
    optimizer = model.optimizer
    assert isinstance(optimizer, tfmp.LossScaleOptimizer) and not optimizer.loss_scaling
    assert np.isfinite(model.get_weights()[0]).all()
    assert (
        _counter(optimizer, "overflow_count"),
        _counter(optimizer, "total_steps"),
    ) == (1, 4)
    assert optimizer.loss_scale == 1.0


# Item 3: stuck detection --------------------------------------------------------------


def _nan_model():
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(1),
            keras.layers.Lambda(lambda t: t * float("nan")),
        ]
    )
    return model


@pytest.mark.parametrize(
    "compile_args",
    [{}, {"run_eagerly": True}, {"jit_compile": True}, {"steps_per_execution": 2}],
    ids=["graph", "eager", "xla", "steps_per_execution"],
)
def test_nan_loss_stops_fit_within_max_consecutive_overflows(compile_args):
    model = _nan_model()
    model.compile(_optimizer(max_consecutive_overflows=4), "mse", **compile_args)
    with pytest.raises(tfmp.NonFiniteError, match="loss itself is non-finite") as info:
        model.fit(np.ones((40, 2)), np.ones((40, 1)), batch_size=2, verbose=0)
    error = info.value
    assert isinstance(error, FloatingPointError)
    assert (error.phase, error.step, error.kind) == ("loss", 3, "nan")
    assert _counter(model.optimizer, "total_steps") == 4
    message = str(error)
    assert (
        "step 3" in message
        and "scale 2048" in message
        and "tfmp.check_numerics" in message
    )
    assert "cannot help" in message


@pytest.mark.parametrize("loss_scaling", [True, False])
def test_defaults_stop_a_nan_run(loss_scaling):
    model = _nan_model()
    model.compile(_optimizer(loss_scaling=loss_scaling), "mse")
    with pytest.raises(tfmp.NonFiniteError):
        model.fit(np.ones((80, 2)), np.ones((80, 1)), batch_size=2, verbose=0)
    # The documented defaults (README): stuck after 3 overflows in a row at
    # min_scale, or after 32 in a row. With scaling: 2**15 halves to min_scale 1 in
    # 15 steps, then 3 more: 18; without: 32 steps at the fixed scale 1.
    assert _counter(model.optimizer, "total_steps") == (18 if loss_scaling else 32)
    assert model.optimizer.loss_scale == 1.0


@tf.custom_gradient
def _exploding_gradient(x):
    return x, lambda dy: dy * float("inf")


def test_gradient_overflow_at_min_scale_stops_fit():
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(1),
            keras.layers.Lambda(_exploding_gradient),
        ]
    )
    model.compile(_optimizer(initial_scale=4.0), "mse")
    with pytest.raises(tfmp.NonFiniteError, match="gradients overflow") as info:
        model.fit(np.ones((40, 2)), np.ones((40, 1)), batch_size=2, verbose=0)
    assert info.value.phase == "gradients" and info.value.kind is None
    # 4 -> 2 -> 1 (2 steps), then 3 overflows in a row at min_scale 1 (README): 5.
    assert _counter(model.optimizer, "total_steps") == 5
    assert "min_scale=1" in str(info.value)


def test_warn_keeps_training_and_warns_once_per_stuck_run():
    model = _nan_model()
    model.compile(_optimizer(max_consecutive_overflows=3, on_stuck="warn"), "mse")
    with pytest.warns(RuntimeWarning, match="Training is stuck") as record:
        model.fit(np.ones((20, 2)), np.ones((20, 1)), batch_size=2, verbose=0)
    assert len([w for w in record if "Training is stuck" in str(w.message)]) == 1
    assert _counter(model.optimizer, "total_steps") == 10


# Item 10: arguments ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"initial_scale": 0.0}, "initial_scale"),
        ({"initial_scale": -2.0}, "initial_scale"),
        ({"initial_scale": INF}, "initial_scale"),
        ({"initial_scale": float("nan")}, "initial_scale"),
        ({"initial_scale": 2.0**30}, "initial_scale"),
        ({"min_scale": 64.0, "max_scale": 32.0, "initial_scale": 32.0}, "min_scale"),
        ({"dynamic_growth_steps": 0}, "dynamic_growth_steps"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"max_consecutive_overflows": 0}, "max_consecutive_overflows"),
        ({"loss_scaling": "yes"}, "loss_scaling"),
    ],
)
def test_bad_arguments_raise_template_error(kwargs, name):
    with pytest.raises(
        ValueError, match=rf"Invalid `{name}` argument\. Expected .* Received: {name}="
    ):
        _optimizer(**kwargs)


def test_on_stuck_typo_suggests_fix():
    with pytest.raises(ValueError, match="Did you mean 'raise'"):
        _optimizer(on_stuck="rasie")


# Item 9 (config part) ------------------------------------------------------------------


def test_config_round_trips_every_argument():
    new_args = {
        "initial_scale": 64.0,
        "dynamic_growth_steps": 7,
        "min_scale": 2.0,
        "max_scale": 2.0**10,
        "hysteresis": 3,
        "max_consecutive_overflows": 9,
        "on_stuck": "warn",
        "loss_scaling": False,
        "guard": "gradients",
    }
    optimizer = _optimizer(name="ls", **new_args)
    config = optimizer.get_config()
    assert {k: config[k] for k in new_args} == new_args
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(optimizer)
    )
    assert type(restored) is tfmp.LossScaleOptimizer
    assert restored.get_config() == config
    assert (
        keras.saving.get_registered_name(tfmp.LossScaleOptimizer)
        == "tfmp>LossScaleOptimizer"
    )


# wrap_optimizer ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "identifier",
    [
        "adam",
        {"class_name": "Adam", "config": {"learning_rate": 0.01}},
        keras.optimizers.Adam,
    ],
)
@pytest.mark.parametrize(
    "dtype, scaling", [("float16", True), ("bfloat16", False), ("float32", False)]
)
def test_wrap_optimizer_identifiers_and_dtypes(identifier, dtype, scaling):
    identifier = identifier() if isinstance(identifier, type) else identifier
    wrapped = _loss_scale.wrap_optimizer(identifier, dtype)
    assert isinstance(wrapped, tfmp.LossScaleOptimizer)
    assert isinstance(wrapped.inner_optimizer, keras.optimizers.Adam)
    assert wrapped.loss_scaling is scaling


def test_wrap_optimizer_keeps_tfmp_and_rewraps_keras():
    mine = _optimizer()
    assert _loss_scale.wrap_optimizer(mine, "float16") is mine
    inner = keras.optimizers.SGD()
    keras_lso = keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=128.0, dynamic_growth_steps=5
    )
    wrapped = _loss_scale.wrap_optimizer(keras_lso, "float16", hysteresis=2)
    assert wrapped.inner_optimizer is inner
    assert (
        wrapped.initial_scale,
        wrapped.dynamic_growth_steps,
        wrapped.hysteresis,
    ) == (128.0, 5, 2)


def test_wrap_optimizer_rejects_unknown_option_and_dtype():
    with pytest.raises(
        ValueError, match="Received: options='hysterisis'.*Did you mean 'hysteresis'"
    ):
        _loss_scale.wrap_optimizer("sgd", "float16", hysterisis=2)
    with pytest.raises(ValueError, match="Invalid `compute_dtype` argument"):
        _loss_scale.wrap_optimizer("sgd", "fp16")


def test_public_names():
    assert issubclass(tfmp.LossScaleOptimizer, keras.optimizers.LossScaleOptimizer)
    assert {"LossScaleOptimizer", "scaled_gradients"} <= set(tfmp.__all__)


# Keras's own scenarios (keras/src/optimizers/loss_scale_optimizer_test.py) --------------


def test_keras_apply_with_no_vars():
    optimizer = _optimizer()
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(variables)
    optimizer.apply([tf.constant(FINITE) * optimizer.initial_scale])
    np.testing.assert_allclose(variables[0].numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-4)


@pytest.mark.parametrize("inner_factor", [None, 100.0])
def test_keras_finite_step(inner_factor):
    optimizer = tfmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5, loss_scale_factor=inner_factor)
    )
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.apply([tf.constant(FINITE) * optimizer.initial_scale], variables)
    np.testing.assert_allclose(variables[0].numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-4)


def test_keras_infinite_step():
    optimizer = _optimizer()
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.apply([tf.constant([INF] * 4)], variables)
    np.testing.assert_array_equal(variables[0].numpy(), [1.0, 2.0, 3.0, 4.0])



@pytest.mark.parametrize("bad", [None, INF, float("nan")])
def test_a_sparse_gradient_is_checked_on_its_values_without_a_dense_copy(bad):
    """An embedding's ``tf.IndexedSlices`` gradient: a non-finite row skips the step, a finite one applies,
    and the traced check makes no table-sized tensor (Keras's ``ops.isfinite`` scatters into one)."""
    optimizer = _optimizer()
    table = keras.Variable(np.ones((1000, 4), "float32"))
    values = np.full((2, 4), 0.5 * optimizer.initial_scale, "float32")
    if bad is not None:
        values[1, 2] = bad
    gradient = tf.IndexedSlices(tf.constant(values), tf.constant([3, 7]), tf.constant([1000, 4]))
    optimizer.apply([gradient], [table])
    after = table.numpy()
    if bad is None:
        np.testing.assert_allclose(after[[3, 7]], 0.75)
    else:
        np.testing.assert_array_equal(after[[3, 7]], 1.0)
    np.testing.assert_array_equal(np.delete(after, [3, 7], axis=0), 1.0)

    traced = tf.function(lambda v, i: optimizer.check_finite(
        [tf.IndexedSlices(v, i, tf.constant([1000, 4]))])).get_concrete_function(
        tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None], tf.int32))
    assert bool(traced(tf.constant(values), tf.constant([3, 7]))) is (bad is None)
    kinds = {op.type for op in traced.graph.get_operations()}
    assert not kinds & {"TensorScatterUpdate", "Fill", "ScatterNd"}, kinds

def test_keras_finite_step_with_overwrite():
    optimizer = _optimizer()
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    variables[0].overwrite_with_gradient = True
    optimizer.apply([tf.constant(FINITE)], variables)
    np.testing.assert_allclose(variables[0].numpy(), FINITE)


def test_keras_downscaling_and_upscaling_via_scale_loss():
    down = _optimizer(initial_scale=400.0)
    _run(down, [[INF] * 4] * 4, keras.Variable([1.0, 2.0, 3.0, 4.0]))
    assert float(down.scale_loss(1.0)) == 25.0
    up = _optimizer(initial_scale=2.0, dynamic_growth_steps=2)
    _run(up, [FINITE] * 8, keras.Variable([1.0, 2.0, 3.0, 4.0]))
    assert float(up.scale_loss(1.0)) == 32.0


def test_keras_iterations_update():
    optimizer = _optimizer()
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(variables)
    assert int(optimizer.iterations.numpy()) == 0
    for i in range(3):
        optimizer.apply([tf.constant(FINITE)], variables)
        assert int(optimizer.iterations.numpy()) == i + 1


def test_keras_serialization():
    optimizer = _optimizer(initial_scale=4.0, dynamic_growth_steps=2, name="test_opt")
    config = optimizer.get_config()
    assert (
        config["name"],
        config["initial_scale"],
        config["dynamic_growth_steps"],
    ) == ("test_opt", 4.0, 2)
    assert "inner_optimizer" in config
    tfmp.LossScaleOptimizer.from_config(config)


def test_keras_dynamic_and_unsupported_args():
    _optimizer(dynamic=True)
    with pytest.raises(ValueError, match="set `loss_scale_factor`"):
        _optimizer(dynamic=False)
    with pytest.raises(ValueError, match=r"Invalid `foo` argument\. .* Received: foo=True .* Unknown argument 'foo'"
                       r"\. Remove it, or use one of those listed\. Unknown argument 'bar'\."):
        _optimizer(foo=True, bar=3)
    with pytest.raises(ValueError, match=r"Unknown argument 'gaurd'\. Did you mean 'guard'\?"):  # named first
        _optimizer(dynamic=False, gaurd="batch")


@pytest.mark.parametrize(
    "arg_name, arg_value",
    [
        ("weight_decay", 0.5),
        ("clipnorm", 0.5),
        ("global_clipnorm", 0.5),
        ("clipvalue", 0.5),
        ("use_ema", True),
        ("ema_momentum", 0.5),
        ("ema_overwrite_frequency", 2),
        ("loss_scale_factor", 0.5),
        ("gradient_accumulation_steps", 2),
    ],
)
def test_keras_base_optimizer_args_belong_on_inner(arg_name, arg_value):
    with pytest.raises(ValueError, match="on the `inner_optimizer`"):
        _optimizer(**{arg_name: arg_value})


def test_keras_deserialization_backwards_compatibility():
    base = {
        "weight_decay": None,
        "clipnorm": None,
        "global_clipnorm": None,
        "clipvalue": None,
        "use_ema": False,
        "ema_momentum": 0.99,
        "ema_overwrite_frequency": None,
        "loss_scale_factor": None,
        "gradient_accumulation_steps": None,
    }
    inner = {"module": "keras.optimizers", "class_name": "SGD", "registered_name": None}
    inner["config"] = {
        "name": "SGD",
        "learning_rate": 0.5,
        "momentum": 0.0,
        "nesterov": False,
        **base,
    }
    config = {"name": "loss_scale_optimizer", **base, "inner_optimizer": inner}
    config.update(initial_scale=2.0, dynamic_growth_steps=2)
    restored = tfmp.LossScaleOptimizer.from_config(config)
    # The saved settings come back, not defaults.
    assert (restored.initial_scale, restored.dynamic_growth_steps) == (2.0, 2)
    assert restored.loss_scaling
    assert type(restored.inner_optimizer) is keras.optimizers.SGD
    assert float(restored.inner_optimizer.learning_rate) == 0.5


def test_stateless_apply_is_refused_with_what_to_call_instead():
    variable = keras.Variable([1.0])
    optimizer = _optimizer()
    optimizer.build([variable])
    before = [v.numpy().copy() for v in optimizer.variables]
    with pytest.raises(NotImplementedError, match=r"stateless_apply is not supported.*optimizer\.apply"):
        optimizer.stateless_apply([v.value for v in optimizer.variables], [tf.constant([1.0])], [variable])
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, optimizer.variables))


@pytest.mark.parametrize("loss_scaling", [True, False])
def test_a_non_finite_loss_is_explained_by_the_compute_dtypes_range(loss_scaling):
    from tfmp._src.constants import NON_FINITE_KINDS
    from tfmp._src.loss_scale import loops as skips

    nan = next(bits for bits, kind in NON_FINITE_KINDS.items() if kind == "nan")
    phase, kind, sentence, fix = skips.cause(nan, loss_scaling)  # the loss's bits, a finite batch
    assert (phase, kind) == ("loss", "nan")
    if loss_scaling:  # float16
        assert "float16 holds at most 65504" in sentence
    else:  # bfloat16 or float32: their range is float32's
        assert "65504" not in sentence and "3.4e38" in sentence
    assert fix.startswith("Fix: tfmp.check_numerics(model)")


def test_an_inner_optimizers_argument_given_to_the_wrapper_is_sent_to_the_inner_optimizer():
    with pytest.raises(ValueError, match=r"Unknown argument 'learning_rate': it is the inner optimizer's; set it "
                       r"there, e\.g\. tfmp\.LossScaleOptimizer\(keras\.optimizers\.SGD\(learning_rate=\.\.\.\)\)"):
        _optimizer(learning_rate=0.1)


def test_the_optimizer_prints_what_it_is():
    adam = tfmp.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=2.0**10, name="scaled")
    assert repr(adam) == "tfmp.LossScaleOptimizer(Adam, name='scaled'): dynamic loss scale 1024, guard='auto'"
    sgd = tfmp.LossScaleOptimizer(keras.optimizers.SGD(), loss_scaling=False, guard="values", name="fixed")
    assert str(sgd) == "tfmp.LossScaleOptimizer(SGD, name='fixed'): no loss scaling, guard='values'"

    adam.build([keras.Variable([1.0])])

    @tf.function
    def traced():  # a built optimizer's scale is a variable, not read while traced
        return tf.constant(len(repr(adam)))

    assert int(traced()) == len("tfmp.LossScaleOptimizer(Adam, name='scaled'): dynamic loss scale, guard='auto'")


def test_a_gradient_without_a_graph_op_is_unscaled_not_refused_in_a_traced_step():
    """The check for gradients clipped while scaled (`guard.clipped_while_scaled`) follows only
    gradients that have a graph op: a NumPy gradient handed in a traced step is unscaled like
    a tensor, and a None stays None."""
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)

    @tf.function
    def unscale():
        return optimizer.get_unscaled_gradients([np.full((2,), 8.0, "float32"), None])

    got, missing = unscale()
    np.testing.assert_array_equal(got.numpy(), [2.0, 2.0])
    assert missing is None


def test_the_inner_optimizers_public_settings_read_through_the_wrapper():
    """`LossScaleOptimizer.__getattr__` hands a public name it lacks to the inner optimizer
    (Adam's beta_1 and amsgrad); a private one stays an AttributeError of the wrapper."""
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3, beta_1=0.8))
    assert optimizer.beta_1 == 0.8 and optimizer.amsgrad is False
    with pytest.raises(AttributeError, match="'LossScaleOptimizer' object has no attribute '_not_there'"):
        optimizer._not_there  # noqa: B018
