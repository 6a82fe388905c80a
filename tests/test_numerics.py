"""Tests for tfmp.check_numerics (tfmp/_numerics.py and its record/report helpers)."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from _xla import assert_same_step_results, not_under_xla

BATCH = 8


def _data(steps=6, zero_at=None, nan_at=None, seed=0):
    """Inputs in [1, 2) (so 1/x is finite), one batch per step, unshuffled."""
    rng = np.random.RandomState(seed)
    x = rng.uniform(1.0, 2.0, (steps * BATCH, 4)).astype("float32")
    y = rng.uniform(0.0, 1.0, (steps * BATCH, 2)).astype("float32")
    if zero_at is not None:
        x[zero_at * BATCH + 3, 0] = 0.0
    if nan_at is not None:
        x[nan_at[0] * BATCH + 1, nan_at[1]] = np.nan
    return x, y


def _divide_model():
    """Dense -> Lambda dividing by input feature 0 -> Dense; only the Lambda sees the zero."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="d1")(inputs)
    ratio = keras.layers.Lambda(lambda ts: ts[0] / ts[1][:, :1], name="divide")([hidden, inputs])
    outputs = keras.layers.Dense(2, name="d2")(ratio)
    return keras.Model(inputs, outputs, name="net")


def _mlp(output_dtype=None, seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu", name="d1"),
            keras.layers.Dense(2, name="d2", dtype=output_dtype),
        ],
        name="mlp",
    )


def _fit(model, x, y, **kwargs):
    return model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, **kwargs)


@pytest.mark.parametrize("mode", ["graph", "eager", "xla"])
def test_lambda_dividing_by_zero_at_step_k_names_layer_phase_and_step(mode):
    model = _divide_model()
    handle = tfmp.check_numerics(model)  # before compile
    model.compile("sgd", "mse", run_eagerly=mode == "eager", jit_compile=mode == "xla")
    x, y = _data(zero_at=4)
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit(model, x, y)
    error = info.value
    assert isinstance(error, FloatingPointError)
    assert (error.layer, error.phase, error.step, error.kind) == ("divide", "forward", 4, "inf")
    assert "Lambda" in str(error) and error.details["layer_class"] == "Lambda"
    low, high = error.details["input_range"]
    assert low <= 0.0 <= high  # the zero it divided by
    assert handle.failures == [error]


def test_hooks_added_after_compile_and_fit_rebuild_the_train_function():
    model = _divide_model()
    model.compile("sgd", "mse")
    x, y = _data(zero_at=2)
    _fit(model, x[:16], y[:16])  # train function built without hooks
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit(model, x, y)
    assert (info.value.layer, info.value.step) == ("divide", 2)
    with pytest.raises(tfmp.NonFiniteError) as info:  # reported once, then re-armed:
        _fit(model, x, y)
    # plain SGD applied step 2's non-finite gradients, so the next step (3) finds d1 bad.
    assert (info.value.layer, info.value.step) == ("d1", 3)
    assert all(1.0 <= bound < 2.0 for bound in info.value.details["input_range"])  # clean inputs, bad weights


def test_steps_per_execution_reports_the_first_failing_step():
    model = _divide_model()
    model.compile("sgd", "mse", steps_per_execution=3)
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit(model, *_data(zero_at=4))  # steps 3..5 run in one call; 4 fails, 5 sees NaN weights
    assert (info.value.layer, info.value.step) == ("divide", 4)


def test_nan_in_data_names_the_first_layer_that_saw_it():
    model = _mlp()
    model.compile("sgd", "mse")
    tfmp.check_numerics(model)
    x, y = _data(nan_at=(3, 2))
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit(model, x, y)
    error = info.value
    assert (error.layer, error.phase, error.step, error.kind) == ("d1", "forward", 3, "nan")
    assert np.isnan(error.details["input_range"][0])
    assert error.details["trace"][-1]["input_kind"] == "nan"
    assert "check_dataset" in str(error)


def test_error_carries_the_min_max_trace_growing_to_float16_overflow():
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential(
        [keras.Input((4,))] + [keras.layers.Lambda(lambda t: t * 64.0, name=f"times64_{i}") for i in range(3)]
        + [keras.layers.Dense(2, name="out", dtype="float32")],
        name="grow",
    )
    model.compile("sgd", "mse")
    tfmp.check_numerics(model, trace_length=4)
    x = np.ones((BATCH, 4), "float32")
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit(model, x, np.zeros((BATCH, 2), "float32"))
    error = info.value
    assert (error.layer, error.step, error.kind) == ("times64_2", 0, "inf")
    trace = error.details["trace"]
    assert [item["layer"] for item in trace] == ["times64_0", "times64_1", "times64_2"]
    assert [item["abs_max"] for item in trace] == [64.0, 4096.0, float("inf")]  # 64**3 > 65504
    assert [item["dtype"] for item in trace] == ["float16"] * 3
    assert "65504" in str(error) and "times64_1" in str(error)


@pytest.mark.parametrize("optimizer_class", ["keras", "tfmp"])
def test_healthy_float16_run_from_scale_2_30_trains_30_steps(optimizer_class):
    keras.config.set_dtype_policy("mixed_float16")
    model = _mlp(output_dtype="float32")
    if optimizer_class == "keras":
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**30)
    else:
        optimizer = tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**30, max_scale=2.0**30)
    model.compile(optimizer, "mse")
    handle = tfmp.check_numerics(model)
    x, y = _data(steps=30)
    history = _fit(model, x, y)
    assert handle.failures == []
    assert np.isfinite(history.history["loss"][0])
    assert optimizer.dynamic_scale.numpy() < 2.0**30  # its first steps did overflow


def _sqrt_relu_model(seed=2):
    """Finite forward, but d/dt sqrt(relu(t)) at t = 0 is inf * 0 = NaN for d1's weights."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="d1", kernel_initializer="zeros"),
            keras.layers.Lambda(lambda t: tf.sqrt(tf.nn.relu(t)), name="sqrt"),
            keras.layers.Dense(2, name="d2", dtype="float32"),
        ],
        name="sq",
    )


#: The premise of `_sqrt_relu_model`'s NaN, which XLA does not keep.
RELU_GRAD_NAN = ("the NaN gradient is TensorFlow's ReluGrad kernel multiplying inf by 0 at relu(0); "
                 "XLA's ReluGrad is a select that passes 0 there, so every gradient stays finite")


@not_under_xla(RELU_GRAD_NAN)
def test_non_finite_gradient_counts_at_once_in_float32():
    model = _sqrt_relu_model()
    model.compile("sgd", "mse")
    tfmp.check_numerics(model, phase="backward")
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit(model, *_data())
    error = info.value
    # d1's weights are the first with a NaN gradient, but sqrt's backward pass made it
    # (tests/test_numerics_backward.py).
    assert (error.layer, error.phase, error.step, error.kind) == ("sqrt", "backward", 0, "nan")
    assert error.details["bad_gradients"] == 2 and error.details["variable"] is None


@not_under_xla(RELU_GRAD_NAN)
def test_float16_gradient_counts_only_once_the_scale_is_at_its_floor():
    keras.config.set_dtype_policy("mixed_float16")
    model = _sqrt_relu_model()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=4.0)
    model.compile(optimizer, "mse")
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit(model, *_data())
    # Steps 0 and 1 overflow at scales 4 and 2 and are skipped; at scale 1 it is real.
    assert (info.value.phase, info.value.step, info.value.details["loss_scale"]) == ("backward", 2, 1.0)
    assert "floor" in str(info.value)


def test_empty_outputs_are_not_mistaken_for_inf():
    inputs = keras.Input((4,))
    empty = keras.layers.Lambda(lambda t: t[:, :0], name="empty")(inputs)  # min/max of nothing: +-inf
    outputs = keras.layers.Concatenate()([keras.layers.Dense(2)(inputs), empty])
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    handle = tfmp.check_numerics(model)
    _fit(model, *_data(steps=2))
    assert handle.failures == []


def test_non_finite_loss_with_finite_layers_is_phase_loss():
    model = _mlp()
    model.compile("sgd", loss=lambda y_true, y_pred: tf.reduce_mean(tf.math.log(y_pred * 0.0)))
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit(model, *_data())
    assert (info.value.layer, info.value.phase, info.value.step) == (None, "loss", 0)


def test_warn_and_log_actions_keep_training(caplog):
    x, y = _data(zero_at=1)
    model = _divide_model()
    model.compile("sgd", "mse")
    handle = tfmp.check_numerics(model, action="warn")
    with pytest.warns(RuntimeWarning, match="divide"):
        _fit(model, x, y)
    assert [(e.layer, e.step) for e in handle.failures][:1] == [("divide", 1)]
    model = _divide_model()  # the warned run went on with an inf, its weights are NaN now
    model.compile("sgd", "mse")
    handle = tfmp.check_numerics(model, action="log")
    with caplog.at_level(logging.WARNING, logger="tfmp"):
        _fit(model, x, y)
    assert "divide" in caplog.text and handle.failures


def test_layer_selection_checks_only_the_chosen_layers():
    model = _divide_model()
    model.compile("sgd", "mse")
    handle = tfmp.check_numerics(model, layers=["d2"])
    assert [layer.name for layer in handle.layers] == ["d2"]
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit(model, *_data(zero_at=1))
    assert (info.value.layer, info.value.step) == ("d2", 1)  # divide is not checked
    assert "in its inputs" in str(info.value) or "inputs were already non-finite" in str(info.value)
    model = _mlp()
    assert [layer.name for layer in tfmp.check_numerics(model, layers=keras.layers.Dense).layers] == ["d1", "d2"]
    assert tfmp.check_numerics(model, layers=lambda layer: layer.name == "d1").layers[0].name == "d1"
    assert [layer.name for layer in tfmp.check_numerics(model, phase="backward").layers] == ["d1", "d2"]


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"action": "rase"}, "Did you mean 'raise'?"),
        ({"phase": "forwards"}, "Did you mean 'forward'?"),
        ({"trace_length": 0}, "integer >= 1"),
        ({"layers": ["nope"]}, "Received: layers='nope'"),
    ],
)
def test_invalid_arguments_use_the_error_template(kwargs, text):
    with pytest.raises(ValueError, match="Invalid `") as info:
        tfmp.check_numerics(_mlp(), **kwargs)
    assert text in str(info.value)


def test_hooks_are_transparent_and_removable():
    x, y = _data(steps=4)
    results = []
    for hooked in (False, True):
        model = _mlp(seed=3)
        model.compile("sgd", "mse")
        handle = tfmp.check_numerics(model) if hooked else None
        losses = [float(model.train_on_batch(x[i : i + BATCH], y[i : i + BATCH])) for i in range(0, len(x), BATCH)]
        results.append((losses, [w.numpy() for w in model.weights]))
    (plain_losses, plain_weights), (hooked_losses, hooked_weights) = results
    assert_same_step_results(plain_losses, plain_weights, hooked_losses, hooked_weights)

    handle.remove()
    assert all("call" not in vars(layer) for layer in model.layers)
    assert "train_step" not in vars(model) and "apply" not in vars(model.optimizer)
    _fit(model, *_data(zero_at=0))  # no hooks: trains on through the inf
    with tfmp.check_numerics(model) as handle:
        assert "call" in vars(model.layers[0])
    assert not handle.active and "call" not in vars(model.layers[0])
    tfmp.check_numerics(model)
    assert tfmp.check_numerics(model, enabled=False) is None
    assert "call" not in vars(model.layers[0])


def test_benchmark_script_prints_both_ratios(monkeypatch, capsys):
    """Item 8: the overhead benchmark runs (tiny settings) and prints both ratios per model."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "numerics_overhead.py"
    spec = importlib.util.spec_from_file_location("numerics_overhead", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    monkeypatch.setattr("sys.argv", ["numerics_overhead.py", "--steps", "2", "--rounds", "1", "--threads", "0"])
    benchmark.main()
    lines = capsys.readouterr().out.splitlines()
    for model in ("digits MLP", "small CNN"):
        for mode in ("all layers", "loss+gradients"):
            assert any(line.startswith(model) and mode in line and "ratio" in line for line in lines)


# -- bounds on the sizes that allocate (issue 25) -------------------------------


def test_trace_length_bound_accepts_the_limit_and_refuses_one_more():
    from tfmp._src.numerics.check import MAX_TRACE_LENGTH

    assert MAX_TRACE_LENGTH == 1024
    model = _mlp()
    with tfmp.check_numerics(model, trace_length=1024) as handle:  # 2 x [1024, 6] float32: 48 KiB
        assert handle.recorder.window.shape == (1024, 6)
    with pytest.raises(ValueError) as info:
        tfmp.check_numerics(model, trace_length=1025)  # refused before any variable is made
    message = str(info.value)
    assert message.startswith("Invalid `trace_length` argument. Expected an integer >= 1 and <= 1024 (")
    assert "Received: trace_length=1025 (of type int). Pass e.g. trace_length=8" in message
    with pytest.raises(ValueError, match=r"Received: trace_length=1000000000 "):
        tfmp.check_numerics(model, trace_length=10**9)


def test_trace_length_bound_is_checked_by_enable_before_any_state_changes():
    with pytest.raises(ValueError, match=r"Invalid `trace_length` argument.*<= 1024.*Received: trace_length=1025"):
        tfmp.enable("float32", debug={"trace_length": 1025})
    assert not tfmp._src.policy.enable.is_enabled()


def _softmax_classifier(divide=False, seed=3):
    """Dense -> (Lambda dividing by input feature 0) -> Dense softmax head: the commonest classifier."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="d1")(inputs)
    if divide:
        hidden = keras.layers.Lambda(lambda ts: ts[0] / ts[1][:, :1], name="divide")([hidden, inputs])
    outputs = keras.layers.Dense(3, activation="softmax", name="probabilities")(hidden)
    return keras.Model(inputs, outputs, name="classifier")


def _class_ids(y):
    return (y[:, 0] * 3).astype("int32")  # three classes from the uniform targets


def _fit_classifier(policy, divide=False, checked=False, **data):
    """History of 1 epoch of 6 steps of sparse categorical cross-entropy on probabilities (Keras
    clips them in the loss): under tfmp's `policy` if `checked`, else plain Keras's."""
    x, y = _data(**data)
    if checked:
        tfmp.enable(policy, verbose=False)
    else:
        keras.config.set_dtype_policy(policy)
    try:
        model = _softmax_classifier(divide)
        model.compile("adam", "sparse_categorical_crossentropy")
        if checked:
            tfmp.check_numerics(model)
        return _fit(model, x, _class_ids(y)).history["loss"]
    finally:
        if checked:
            tfmp.disable()


def test_a_healthy_float16_softmax_classifier_with_sparse_cross_entropy_trains_under_check_numerics():
    """The gradient of the loss's own clip of the probabilities is not a clip of the scaled
    gradients (`guard.clipped_while_scaled`): training goes on, as float32's and plain Keras's."""
    reference = _fit_classifier("float32")
    plain = _fit_classifier("mixed_float16")
    checked = _fit_classifier("mixed_float16", checked=True)
    assert np.isfinite(plain).all()  # plain Keras trains too (its float16 softmax: ~2% off float32)
    np.testing.assert_allclose(checked, reference, rtol=5e-3)


def test_a_float16_softmax_classifier_with_sparse_cross_entropy_gets_the_layer_that_divided_by_zero():
    plain = _fit_classifier("mixed_float16", divide=True, zero_at=2)
    assert np.isnan(plain[0])  # plain Keras trains on: its loss is NaN, no layer named
    with pytest.raises(tfmp.NonFiniteError) as info:
        _fit_classifier("mixed_float16", divide=True, checked=True, zero_at=2)
    error = info.value
    assert (error.layer, error.phase, error.step, error.kind) == ("divide", "forward", 2, "inf")


_COMPILES_SCRIPT = """
import numpy as np, keras, tfmp
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
model.compile("sgd", "mse", jit_compile=True)
tfmp.check_numerics(model)
rng = np.random.default_rng(0)
model.fit(rng.random((48, 4), "float32"), rng.random((48, 2), "float32"), batch_size=8, shuffle=False, verbose=0)
"""


def test_under_xla_the_checked_train_step_compiles_once_not_at_every_step():
    """Six steps with new data and weights, one XLA compilation: no op of the checks makes XLA
    take the step's data (or weights) as compile-time constants, which would compile every step."""
    import subprocess
    import sys

    from _subproc import ROOT, script_env

    env = script_env({"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "device_compiler=1"})
    run = subprocess.run([sys.executable, "-c", _COMPILES_SCRIPT], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("Compilation of XLA executable") == 1, run.stderr[-3000:]
