"""Nothing a user sets or saves is lost under tfmp.

Loading while enabled gives back the saved model; every setting of Keras's base
optimizer reads and writes through `tfmp.LossScaleOptimizer`; the optimizer's
`get_unscaled_gradients` is pure; tfmp's state is per thread; a model compiled
before `enable()` warns once; under float32 `enable()` keeps the user's optimizer.
Values are powers of two (or exactly representable in bfloat16) wherever the test
compares with a float32 reference for exact equality.
"""

import inspect
import threading
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _machines import A100
from _traced import forward_and_backward_ops, op_counts

import tfmp
from tfmp._src.float32 import bias_gradient
from tfmp._src.loss_scale import optimizer as _loss_scale
from tfmp._src.policy import enable as _enable
from tfmp._src.policy.hardware import injected_facts

ORIGINAL_COMPILE = keras.Model.compile
STATE = _loss_scale.STATE_VARIABLES


@pytest.fixture(autouse=True)
def always_disable():
    yield
    tfmp.disable()
    assert keras.Model.compile is ORIGINAL_COMPILE


def _quiet_enable(policy, **options):
    """`tfmp.enable` without its 'slower than float32 here' warning (CPU without 16-bit units)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        return tfmp.enable(policy, **options)


# 1. Loading while enabled gives back the saved model --------------------------------

X = np.random.default_rng(0).uniform(-1.0, 1.0, (48, 3)).astype("float32")
Y_SMALL = np.ones((48, 2), "float32")
Y_LARGE = np.full((48, 2), 300.0, "float32")  # float16 gradients overflow at 2**15


def _model(kind):
    init = dict(kernel_initializer=keras.initializers.Constant(0.5), bias_initializer="ones")
    if kind == "sequential":
        return keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4, activation="relu", **init), keras.layers.Dense(2, **init)]
        )
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="relu", **init)(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, **init)(hidden))


def _snapshot(model):
    """Everything a resumed run depends on: optimizer class, config, every variable, weights."""
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return {
        "compiled": model.compiled,
        "class": type(optimizer),
        "inner_class": type(inner),
        "config": optimizer.get_config(),
        "iterations": int(optimizer.iterations.numpy()),
        "variables": [v.numpy().tolist() for v in optimizer.variables],
        # Slot names follow the model variables' paths, which differ between a
        # model and its loaded copy; two loads of one file have the same ones.
        "variable_paths": [v.path for v in optimizer.variables],
        "weights": [w.numpy().tolist() for w in model.weights],
        # Layers that compute. Keras gives a loaded InputLayer (and a loaded
        # Sequential container) the global policy, with or without tfmp; neither
        # computes anything.
        "layer_policies": [layer.dtype_policy.name for layer in model.layers if layer.weights],
        "state": {n: getattr(optimizer, n).numpy().item() for n in STATE}
        if isinstance(optimizer, tfmp.LossScaleOptimizer)
        else None,
    }


def _without_paths(snapshot):
    return {key: value for key, value in snapshot.items() if key != "variable_paths"}


def _load_and_continue(path, policy):
    """Loads `path` (tfmp enabled with `policy`, or disabled for None), then fits 4 steps."""
    if policy is not None:
        _quiet_enable(policy)
    try:
        loaded = keras.models.load_model(path)
        at_load = _snapshot(loaded)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tfmp.PerformanceWarning)  # a loaded model does not warn
            loaded.fit(X[:8], Y_LARGE[:8] if at_load["state"] else Y_SMALL[:8], batch_size=2, shuffle=False, verbose=0)
        return at_load, _snapshot(loaded)
    finally:
        tfmp.disable()


def _saved_plain(tmp_path, kind):
    model = _model(kind)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(X, Y_SMALL, batch_size=8, shuffle=False, verbose=0)
    path = str(tmp_path / "plain.keras")
    model.save(path)
    return path, _snapshot(model)


def _saved_mixed_float16(tmp_path, kind):
    _quiet_enable("mixed_float16")
    try:
        model = _model(kind)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        model.fit(X, Y_LARGE, batch_size=2, shuffle=False, verbose=0)
        path = str(tmp_path / "mixed.keras")
        model.save(path)
        return path, _snapshot(model)
    finally:
        tfmp.disable()


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_loading_a_plain_float32_model_while_enabled_gives_it_back_as_saved(tmp_path, kind):
    path, saved = _saved_plain(tmp_path, kind)
    assert saved["compiled"] and saved["class"] is keras.optimizers.Adam and saved["iterations"] == 6
    # iteration, learning_rate, then Adam's m and v of each of the 4 weights
    assert len(saved["variables"]) == 2 + 2 * 4
    disabled_at_load, disabled_after_fit = _load_and_continue(path, None)
    assert _without_paths(disabled_at_load) == _without_paths(saved)
    for policy in ("auto", "mixed_float16", "mixed_bfloat16"):
        at_load, after_fit = _load_and_continue(path, policy)
        assert at_load == disabled_at_load, policy
        assert after_fit == disabled_after_fit, policy
        assert after_fit["iterations"] == 10


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_loading_a_mixed_float16_model_with_overflows_while_enabled_keeps_its_state(tmp_path, kind):
    path, saved = _saved_mixed_float16(tmp_path, kind)
    assert saved["compiled"] and saved["class"] is tfmp.LossScaleOptimizer
    assert saved["inner_class"] is keras.optimizers.Adam
    # Scale 2**15 halves on 8 overflowing steps down to 128, then 16 finite steps.
    assert saved["state"] == {
        "dynamic_scale": 128.0, "step_counter": 16, "overflow_count": 8, "consecutive_overflows": 0,
        "last_overflow_step": 7, "total_steps": 24, "min_scale_overflows": 0, "last_loss_status": 0,
        "last_overflow_status": 0,  # the skipped steps' batch and loss were finite
    }
    assert saved["iterations"] == 16
    assert saved["layer_policies"] == ["mixed_float16", "float32"]  # the output forced to float32
    # tfmp's 13 own variables (Keras's 4 + 9 counters and histories), Adam's 2 + 8 slots
    assert len(saved["variables"]) == 4 + 9 + 2 + 2 * 4
    disabled_at_load, disabled_after_fit = _load_and_continue(path, None)
    assert _without_paths(disabled_at_load) == _without_paths(saved)
    assert disabled_after_fit["state"]["total_steps"] == 28
    for policy in ("auto", "mixed_float16", "mixed_bfloat16"):
        at_load, after_fit = _load_and_continue(path, policy)
        assert at_load == disabled_at_load, policy
        assert after_fit == disabled_after_fit, policy


# 2. Every setting of Keras's base optimizer reads and writes through the wrapper ----


def _base_optimizer_settings():
    """The named arguments of Keras's base optimizer, from the `__init__` signatures.

    `keras.optimizers.Optimizer.__init__` itself is the backend class's
    ``(*args, **kwargs)``: the names come from the classes of its MRO that define
    ``__init__``, in order.
    """
    names = []
    for klass in keras.optimizers.Optimizer.__mro__:
        if "__init__" not in vars(klass):
            continue
        for parameter in inspect.signature(vars(klass)["__init__"]).parameters.values():
            named = parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
            if named and parameter.name != "self" and parameter.name not in names:
                names.append(parameter.name)
    return tuple(n for n in names if n not in ("learning_rate", "name", "loss_scale_factor"))


SETTINGS = _base_optimizer_settings()
#: For each setting: a value given to the inner optimizer, then one written through the wrapper.
VALUES = {
    "weight_decay": (0.25, 0.125),
    "clipnorm": (2.0, 0.5),
    "clipvalue": (2.0, 0.25),
    "global_clipnorm": (2.0, 0.75),
    "use_ema": (True, False),
    "ema_momentum": (0.5, 0.75),
    "ema_overwrite_frequency": (3, 5),
    "gradient_accumulation_steps": (2, 4),
}


def test_forwarded_settings_are_every_setting_of_the_keras_base_optimizer():
    assert len(SETTINGS) == 8 and SETTINGS[0] == "weight_decay"  # the signatures were read
    assert SETTINGS == _loss_scale.FORWARDED_SETTINGS
    assert tuple(VALUES) == SETTINGS


def _two_layer(kernel=1.0, bias=1.0, name=None):
    init = dict(
        kernel_initializer=keras.initializers.Constant(kernel),
        bias_initializer=keras.initializers.Constant(bias),
    )
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="hidden", **init)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="head", **init)(hidden), name=name)


def _compiled_bf16(optimizer, loss="mse"):
    """A model compiled under ``tfmp.enable("mixed_bfloat16")``: bfloat16 hidden layer, wrapped optimizer."""
    _quiet_enable("mixed_bfloat16")
    model = _two_layer()
    model.compile(optimizer, loss)
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer is optimizer
    assert [layer.compute_dtype for layer in model.layers[1:]] == ["bfloat16", "float32"]
    return model


def _compiled_float32(optimizer, loss="mse"):
    """The float32 reference: the same model and optimizer, without tfmp."""
    model = _two_layer()
    model.compile(optimizer, loss)
    assert model.optimizer is optimizer
    return model


@pytest.mark.parametrize("name", SETTINGS)
def test_each_setting_reads_and_writes_through_and_survives_get_config(name):
    given, written = VALUES[name]
    inner = keras.optimizers.SGD(0.5, **{name: given})
    model = _compiled_bf16(inner)
    wrapper = model.optimizer
    assert getattr(wrapper, name) == given == getattr(inner, name)
    setattr(wrapper, name, written)
    assert getattr(inner, name) == written
    assert getattr(wrapper, name) == written
    assert name not in vars(wrapper)  # no copy on the wrapper that could go stale
    for restored in (
        tfmp.LossScaleOptimizer.from_config(wrapper.get_config()),
        keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(wrapper)),
    ):
        assert type(restored) is tfmp.LossScaleOptimizer
        assert getattr(restored, name) == written == getattr(restored.inner_optimizer, name)
    config = wrapper.get_config()
    assert name not in config  # it lives in the inner optimizer's config only
    assert config["inner_optimizer"]["config"][name] == written


def _zero_loss(y_true, y_pred):
    return 0.0 * keras.ops.mean(y_pred)  # every gradient exactly zero


ONES_X = np.ones((4, 3), "float32")
ZEROS_Y = np.zeros((4, 1), "float32")


def _fit(model, steps=4, callbacks=()):
    model.fit(ONES_X[:steps], ZEROS_Y[:steps], batch_size=1, shuffle=False, verbose=0, callbacks=list(callbacks))
    return {w.path: w.numpy() for w in model.weights}


@pytest.mark.parametrize("exclude", [True, False])
def test_weight_decay_and_exclude_from_weight_decay_act_as_in_float32(exclude):
    results = []
    for compiled in (_compiled_bf16, _compiled_float32):
        model = compiled(keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.5), loss=_zero_loss)
        if exclude:
            model.optimizer.exclude_from_weight_decay(var_names=["bias"])
        results.append(_fit(model))
        tfmp.disable()
    mixed, reference = results
    decayed = np.float32(1.0)
    for _ in range(4):
        decayed = decayed - decayed * np.float32(0.5) * np.float32(0.1)  # Keras's decoupled decay
    assert float(decayed) == pytest.approx(0.95**4, rel=1e-6)
    for path, value in mixed.items():
        np.testing.assert_array_equal(value, reference[path])
        expected = 1.0 if exclude and path.endswith("bias") else decayed
        np.testing.assert_array_equal(value, np.full_like(value, expected), err_msg=path)


def test_weight_decay_set_to_zero_from_a_callback_stops_the_decay():
    class NoDecay(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.model.optimizer.weight_decay = 0.0

    results = []
    for compiled in (_compiled_bf16, _compiled_float32):
        optimizer = keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.5)
        results.append(_fit(compiled(optimizer, loss=_zero_loss), callbacks=[NoDecay()]))
        assert optimizer.weight_decay == 0.0
        tfmp.disable()
    for weights in results:
        for path, value in weights.items():
            np.testing.assert_array_equal(value, np.ones_like(value), err_msg=path)


def _update(before, after):
    return np.concatenate([(after[path] - before[path]).ravel() for path in sorted(before)])


@pytest.mark.parametrize("name", ["global_clipnorm", "clipnorm", "clipvalue"])
def test_clipping_set_through_the_wrapper_bounds_the_update_like_float32(name):
    results = {}
    for compiled, clip in ((_compiled_bf16, True), (_compiled_float32, True), (_compiled_float32, False)):
        model = compiled(keras.optimizers.SGD(1.0))
        before = {w.path: w.numpy() for w in model.weights}
        if clip:
            setattr(model.optimizer, name, 1e-3)
        results[compiled.__name__, clip] = _update(before, _fit(model, steps=1))
        tfmp.disable()
    mixed, reference = results["_compiled_bf16", True], results["_compiled_float32", True]
    unclipped = results["_compiled_float32", False]
    # Every value of this step is exact in bfloat16, so the updates are equal.
    np.testing.assert_array_equal(mixed, reference)
    assert np.linalg.norm(unclipped) > 100.0
    # Within the rounding of 1.0 - update in float32 (half an ulp of 1.0, 6e-8).
    if name == "global_clipnorm":
        assert np.linalg.norm(mixed) == pytest.approx(1e-3, rel=1e-3)
    elif name == "clipnorm":  # per variable, in path order: head/bias, head/kernel, hidden/bias, hidden/kernel
        sizes = [1, 4, 4, 12]
        for part in np.split(mixed, np.cumsum(sizes)[:-1]):
            assert np.linalg.norm(part) == pytest.approx(1e-3, rel=1e-3)
    else:
        np.testing.assert_allclose(mixed, -1e-3, rtol=0, atol=6e-8)


def _compiled_wrapped_float32(optimizer, loss="mse"):
    """Under ``enable("float32")`` with loss-scale options: the wrapper at a fixed scale of 1."""
    _quiet_enable("float32", loss_scale_options={"on_stuck": "raise"})
    model = _two_layer()
    model.compile(optimizer, loss)
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer) and model.optimizer.loss_scale == 1.0
    return model


@pytest.mark.parametrize(
    "make, name, given, written",
    [
        (lambda: keras.optimizers.Adam(0.5, beta_1=0.875), "beta_1", 0.875, 0.5),
        (lambda: keras.optimizers.SGD(0.5, momentum=0.25), "momentum", 0.25, 0.5),
        (lambda: keras.optimizers.SGD(0.5, nesterov=False), "nesterov", False, True),
    ],
)
def test_subclass_settings_read_and_write_through(make, name, given, written):
    model = _compiled_bf16(make())
    assert getattr(model.optimizer, name) == given
    setattr(model.optimizer, name, written)
    assert getattr(model.optimizer.inner_optimizer, name) == written
    assert name not in vars(model.optimizer)
    restored = tfmp.LossScaleOptimizer.from_config(model.optimizer.get_config())
    assert getattr(restored, name) == written


def test_momentum_written_through_the_wrapper_trains_like_float32():
    results = {}
    for compiled in (_compiled_bf16, _compiled_wrapped_float32, _compiled_float32):
        model = compiled(keras.optimizers.SGD(2.0**-6, momentum=0.0))
        model.optimizer.momentum = 0.5
        results[compiled] = _fit(model, steps=2)
        slots = [v for v in model.optimizer.variables if v.path.endswith("_momentum")]
        assert len(slots) == 4  # SGD makes momentum slots when its momentum is not 0
        tfmp.disable()
    without_momentum = _fit(_compiled_float32(keras.optimizers.SGD(2.0**-6)), steps=2)
    reference = results[_compiled_float32]
    for path, value in reference.items():
        np.testing.assert_array_equal(results[_compiled_wrapped_float32][path], value, err_msg=path)
        # bfloat16 keeps 8 significant bits: the hidden layer's gradients round.
        np.testing.assert_allclose(results[_compiled_bf16][path], value, rtol=2e-2, err_msg=path)
    assert abs(reference["hidden/kernel"][0, 0] - without_momentum["hidden/kernel"][0, 0]) > 0.1


def test_unknown_attributes_stay_errors_and_new_ones_stay_on_the_wrapper():
    model = _compiled_bf16(keras.optimizers.SGD(0.5))
    with pytest.raises(AttributeError, match="beta_9"):
        model.optimizer.beta_9
    model.optimizer.run_tag = "a"
    assert vars(model.optimizer)["run_tag"] == "a"
    assert not hasattr(model.optimizer.inner_optimizer, "run_tag")


@pytest.mark.parametrize(
    "setting, marker",
    [
        ({"use_ema": True, "ema_momentum": 0.5}, "_average"),
        ({"gradient_accumulation_steps": 2}, "_gradient_accumulator"),
    ],
    ids=["ema", "accumulation"],
)
def test_ema_and_gradient_accumulation_on_the_inner_optimizer_work_once(setting, marker):
    results = {}
    for compiled in (_compiled_bf16, _compiled_wrapped_float32, _compiled_float32):
        model = compiled(keras.optimizers.SGD(2.0**-6, **setting))
        weights = _fit(model)
        optimizer = model.optimizer
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        results[compiled] = {
            "weights": weights,
            "marked": len([v for v in optimizer.variables if v.path.endswith(marker)]),
            "inner": len(inner.variables),
            "all": len(optimizer.variables),
            "iterations": int(optimizer.iterations.numpy()),
        }
        tfmp.disable()
    reference = results.pop(_compiled_float32)
    # Keras's iteration and learning_rate, then one EMA / accumulator per weight.
    assert (reference["marked"], reference["inner"], reference["all"]) == (4, 2 + 4, 2 + 4)
    assert reference["iterations"] == (2 if "gradient_accumulation_steps" in setting else 4)
    for compiled, result in results.items():
        assert result["marked"] == 4, compiled.__name__  # made once, by the inner optimizer
        assert result["inner"] == reference["inner"]
        assert result["all"] == reference["inner"] + 13  # tfmp's own: Keras's 4, tfmp's 9
        assert result["iterations"] == reference["iterations"]
    for path, value in reference["weights"].items():
        assert not np.array_equal(value, np.ones_like(value)), path  # it trained
        np.testing.assert_array_equal(results[_compiled_wrapped_float32]["weights"][path], value, err_msg=path)
        np.testing.assert_allclose(results[_compiled_bf16]["weights"][path], value, rtol=2e-2, err_msg=path)


def test_loss_scale_factor_on_the_wrapper_raises_the_template_error():
    inner = keras.optimizers.SGD(0.5)
    model = _compiled_bf16(inner)
    with pytest.raises(ValueError, match=r"Invalid `loss_scale_factor` argument\..*Received: loss_scale_factor=128\.0.*initial_scale"):
        model.optimizer.loss_scale_factor = 128.0
    assert inner.loss_scale_factor is None and model.optimizer.loss_scale_factor is None
    model.optimizer.loss_scale_factor = None  # what Keras itself writes: accepted


# 3. get_unscaled_gradients is pure ----------------------------------------------------


def _sgd_at_1024():
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1024.0)
    variable = keras.Variable([8.0])
    optimizer.build([variable])
    return optimizer, variable


def _optimizer_state(optimizer):
    return [v.numpy().tolist() for v in optimizer.variables]


@pytest.mark.filterwarnings("ignore::tfmp.LossScaleWarning")  # constant gradients, no scale_loss
def test_get_unscaled_gradients_changes_nothing_and_apply_unscales_once():
    optimizer, variable = _sgd_at_1024()
    grad = tf.constant([1024.0])
    before = _optimizer_state(optimizer)
    logged = optimizer.get_unscaled_gradients([grad, None])
    assert float(tf.norm(logged[0])) == 1.0 and logged[1] is None
    assert _optimizer_state(optimizer) == before  # pure: no variable moved
    optimizer.apply([grad], [variable])
    assert variable.numpy().tolist() == [7.0]  # -1, not -1024 and not -1/1024
    assert int(optimizer.iterations.numpy()) == 1 and optimizer.loss_scale == 1024.0


@pytest.mark.filterwarnings("ignore::tfmp.LossScaleWarning")  # constant gradients, no scale_loss
def test_tf_keras_2_flow_unscales_exactly_once():
    optimizer, variable = _sgd_at_1024()
    grads = [tf.constant([1024.0])]
    optimizer.apply_gradients(zip(optimizer.get_unscaled_gradients(grads), [variable]))
    assert variable.numpy().tolist() == [7.0]
    optimizer.apply_gradients(zip(grads, [variable]))  # scaled gradients: unscaled there
    assert variable.numpy().tolist() == [6.0]
    assert int(optimizer.total_steps.numpy()) == 2 and int(optimizer.overflow_count.numpy()) == 0


@pytest.mark.filterwarnings("ignore::tfmp.LossScaleWarning")  # constant gradients, no scale_loss
def test_both_flows_in_one_tf_function_traced_once_and_called_alternately():
    optimizer, variable = _sgd_at_1024()

    @tf.function
    def step(grad, tf_keras_2):
        def log_then_apply():
            norm = tf.norm(optimizer.get_unscaled_gradients([grad])[0])
            optimizer.apply([grad], [variable])
            return norm

        def unscale_then_apply_gradients():
            unscaled = optimizer.get_unscaled_gradients([grad])
            optimizer.apply_gradients(zip(unscaled, [variable]))
            return tf.norm(unscaled[0])

        return tf.cond(tf_keras_2, unscale_then_apply_gradients, log_then_apply)

    grad = tf.constant([1024.0])
    values, norms = [], []
    for tf_keras_2 in (False, True, False, True):
        norms.append(float(step(grad, tf.constant(tf_keras_2))))
        values.append(float(variable.numpy()[0]))
    assert step.experimental_get_tracing_count() == 1
    assert values == [7.0, 6.0, 5.0, 4.0] and norms == [1.0] * 4
    assert int(optimizer.iterations.numpy()) == 4 and optimizer.loss_scale == 1024.0


# 4. tfmp's state is per thread, like Keras's policy --------------------------------------


def _in_thread(target):
    """Runs `target` in a new thread; returns what it returned, re-raising what it raised."""
    outcome = {}

    def run():
        try:
            outcome["value"] = target()
        except Exception as error:  # handed to the calling thread
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _compile_plain_sgd():
    sgd = keras.optimizers.SGD(0.5)
    model = _two_layer()
    model.compile(sgd, "mse")
    return {
        "enabled": _enable.is_enabled(),
        "global_policy": keras.config.dtype_policy().name,
        "same_optimizer": model.optimizer is sgd,
        "optimizer_class": type(model.optimizer),
        "compute_dtypes": [layer.compute_dtype for layer in model.layers[1:]],
    }


PLAIN = {
    "enabled": False,
    "global_policy": "float32",
    "same_optimizer": True,
    "optimizer_class": keras.optimizers.SGD,
    "compute_dtypes": ["float32", "float32"],
}


def test_a_model_compiled_in_another_thread_during_a_policy_scope_is_left_alone():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        with tfmp.policy_scope("mixed_bfloat16"):
            assert keras.Model.compile is not ORIGINAL_COMPILE  # the hooks are on
            assert _in_thread(_compile_plain_sgd) == PLAIN
            here = _two_layer()
            here.compile(keras.optimizers.SGD(0.5), "mse")
            assert isinstance(here.optimizer, tfmp.LossScaleOptimizer)
            assert [layer.compute_dtype for layer in here.layers[1:]] == ["bfloat16", "float32"]


def test_enabling_in_a_worker_thread_affects_that_threads_models_only():
    enabled, release = threading.Event(), threading.Event()

    def worker():
        _quiet_enable("mixed_bfloat16")
        try:
            enabled.set()
            release.wait(60)
            sgd = keras.optimizers.SGD(0.5)
            model = _two_layer()
            model.compile(sgd, "mse")
            return {
                "wrapped": type(model.optimizer) is tfmp.LossScaleOptimizer and model.optimizer.inner_optimizer is sgd,
                "compute_dtypes": [layer.compute_dtype for layer in model.layers[1:]],
            }
        finally:
            tfmp.disable()

    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(value=worker()))
    thread.start()
    try:
        assert enabled.wait(60)
        assert keras.Model.compile is not ORIGINAL_COMPILE  # the worker's hooks are on
        assert _compile_plain_sgd() == PLAIN  # this thread: untouched
    finally:
        release.set()
        thread.join()
    assert outcome["value"] == {"wrapped": True, "compute_dtypes": ["bfloat16", "float32"]}
    assert keras.Model.compile is ORIGINAL_COMPILE  # off with the worker's disable()


def test_a_thread_that_ended_enabled_enables_no_later_thread():
    def enable_and_end():
        _quiet_enable("mixed_bfloat16")
        return threading.get_ident()

    def ident_and_state():
        return threading.get_ident(), _enable.is_enabled(), _compile_plain_sgd()

    # CPython reuses the ident of an ended thread (not every time): try until it does.
    try:
        for _ in range(50):
            ended = _in_thread(enable_and_end)
            ident, enabled, compiled = _in_thread(ident_and_state)
            assert (enabled, compiled) == (False, PLAIN)
            if ident == ended:
                break
        else:
            pytest.skip("no thread ident was reused in 50 tries")
    finally:
        tfmp.disable()  # forgets the ended threads; the hooks come off (checked by the fixture)


# 5. enable() after compile() warns once, at the first fit ---------------------------------


def _perf_warnings(call, where=None):
    """Messages of the PerformanceWarnings `call` raises; their (file, line) into `where`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    ours = [w for w in caught if issubclass(w.category, tfmp.PerformanceWarning)]
    if where is not None:
        where.extend((w.filename, w.lineno) for w in ours)
    return [str(w.message) for w in ours]


def _fit_twice(model):
    def call():
        for _ in range(2):
            model.fit(ONES_X, ZEROS_Y, batch_size=2, verbose=0)
    return call


def test_a_model_compiled_before_enable_warns_once_at_its_first_fit():
    early = _two_layer(name="early_model")
    early.compile(keras.optimizers.SGD(0.5), "mse")
    _quiet_enable("mixed_bfloat16")
    where = []
    messages = _perf_warnings(_fit_twice(early), where)
    assert len(messages) == 1
    assert "'early_model' was compiled before tfmp.enable()" in messages[0]
    fit_line = next(number for number, line in enumerate(open(__file__), 1)
                    if "model.fit(ONES_X, ZEROS_Y, batch_size=2" in line)
    assert where == [(__file__, fit_line)]  # the user's fit() call, under every hook
    assert "compile the model after tfmp.enable()" in messages[0]
    assert type(early.optimizer) is keras.optimizers.SGD  # left as compiled


def test_models_compiled_after_enable_or_loaded_while_enabled_do_not_warn(tmp_path):
    saved = _two_layer(name="saved_model")
    saved.compile(keras.optimizers.SGD(0.5), "mse")
    saved.fit(ONES_X, ZEROS_Y, verbose=0)
    path = str(tmp_path / "saved.keras")
    saved.save(path)
    _quiet_enable("mixed_bfloat16")
    late = _two_layer(name="late_model")
    late.compile(keras.optimizers.SGD(0.5), "mse")
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is keras.optimizers.SGD  # as saved
    assert _perf_warnings(_fit_twice(late)) == []
    assert _perf_warnings(_fit_twice(loaded)) == []


def test_a_model_compiled_while_only_another_thread_was_enabled_warns():
    enabled, release = threading.Event(), threading.Event()

    def worker():
        _quiet_enable("mixed_bfloat16")
        enabled.set()
        release.wait(60)
        tfmp.disable()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert enabled.wait(60)
        model = _two_layer(name="other_thread_model")
        model.compile(keras.optimizers.SGD(0.5), "mse")  # tfmp is off in this thread
        _quiet_enable("mixed_bfloat16")
        messages = _perf_warnings(_fit_twice(model))
    finally:
        release.set()
        thread.join()
    assert len(messages) == 1 and "'other_thread_model' was compiled before" in messages[0]


# 6. Under float32, enable() keeps the user's optimizer ------------------------------------


@pytest.mark.parametrize("given", ["instance", "string"])
def test_float32_keeps_the_optimizer_given(given):
    _quiet_enable("float32")
    adam = keras.optimizers.Adam(0.25)
    model = _two_layer()
    model.compile(adam if given == "instance" else "adam", "mse")
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert type(model.optimizer) is keras.optimizers.Adam
    if given == "instance":
        assert model.optimizer is adam
    model.fit(ONES_X, ZEROS_Y, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1


@pytest.mark.parametrize("options", [{"debug": True}, {"loss_scale_options": {"initial_scale": 8.0}}], ids=["debug", "loss_scale_options"])
def test_float32_wraps_when_debug_or_loss_scale_options_ask(options):
    _quiet_enable("float32", **options)
    adam = keras.optimizers.Adam(0.25)
    model = _two_layer()
    model.compile(adam, "mse")
    assert type(model.optimizer) is tfmp.LossScaleOptimizer
    assert model.optimizer.inner_optimizer is adam
    assert model.optimizer.loss_scale == 1.0  # float32 compute: no scaling


def test_where_auto_keeps_float32_the_train_step_is_plain_keras_op_for_op():
    """Where "auto" picks float32 (a CPU without bfloat16), tfmp may cost nothing:
    the traced training step holds the same ops as plain Keras's, one for one."""
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")

    def build():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.LayerNormalization(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # builds the optimizer
        return model

    batch = (tf.constant(x), tf.constant(y))
    plain = op_counts(build().train_step, batch)
    with tfmp.policy_scope("float32"):
        model = build()
        assert not isinstance(model.optimizer, tfmp.LossScaleOptimizer)
        with_tfmp = op_counts(model.train_step, batch)
    assert with_tfmp == plain
    assert plain["AssignVariableOp"] + plain["AssignAddVariableOp"] + plain["AssignSubVariableOp"] > 0


def test_attention_block_forward_and_backward_are_plain_kerass_op_for_op_under_bfloat16():
    """A Transformer block as keras.io writes one (MultiHeadAttention without dropout,
    whose softmax Keras already computes in float32, LayerNormalization, a GELU Dense,
    logits for a from-logits loss): under mixed_bfloat16, on a GPU machine (an A100's
    facts: Keras's GELU and bias gradients), tfmp adds no op and no cast to its forward
    and backward passes; it differs from plain Keras in the optimizer and the guard only
    (on a CPU its GELU ops differ too: tests/test_gelu.py; where TensorFlow's CPU
    BiasAddGrad loses bfloat16 sums, its bias gradients: tests/test_bias_gradient.py)."""
    rng = np.random.default_rng(0)
    tokens = tf.constant(rng.integers(0, 50, size=(4, 12)), tf.int32)
    labels = tf.constant(rng.integers(0, 3, size=(4,)), tf.int32)

    def build():
        inputs = keras.Input((12,), dtype="int32")
        x = keras.layers.Embedding(50, 16)(inputs)
        x = keras.layers.LayerNormalization()(x + keras.layers.MultiHeadAttention(2, 8)(x, x))
        x = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(32, activation="gelu")(x))
        model = keras.Model(inputs, keras.layers.Dense(3)(x))
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    keras.config.set_dtype_policy("mixed_bfloat16")  # restored by the conftest fixture
    plain = forward_and_backward_ops(build(), tokens, labels)
    keras.config.set_dtype_policy("float32")
    with tfmp.policy_scope("mixed_bfloat16"), injected_facts(A100), \
            bias_gradient.injected(loses=False):
        model = build()
        assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
        with_tfmp = forward_and_backward_ops(model, tokens, labels)
    assert with_tfmp == plain
    assert plain["Softmax:float32"] == 1 and plain["Softmax:bfloat16"] == 0
    assert plain["BatchMatMulV2:bfloat16"] + plain["Einsum:bfloat16"] > 0 and plain["Cast:float32"] > 0
