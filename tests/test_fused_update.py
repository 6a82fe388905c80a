"""Adam's and SGD's updates on TensorFlow's fused kernels (tfmp._src.policy.fused_update)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.keras_hooks import patches
from tfmp._src.policy import fused_update

SHAPES = [(33, 17), (17,), (5,)]


def _variables():
    rng = np.random.default_rng(0)
    return [keras.Variable(rng.normal(size=s).astype("float32"), name=f"w{i}")
            for i, s in enumerate(SHAPES)]


def _gradient_steps(steps=5):
    rng = np.random.default_rng(1)
    return [[tf.constant(rng.normal(size=s).astype("float32")) for s in SHAPES] for _ in range(steps)]


def _train(make_optimizer, fused):
    """Applies the same gradients with `make_optimizer()`, fused or not; returns
    (variables, optimizer, op types of the traced apply)."""
    variables = _variables()
    optimizer = make_optimizer()
    optimizer.build(variables)

    @tf.function
    def apply(grads):
        if fused:
            with fused_update.fused_updates(optimizer):
                optimizer.apply(grads, variables)
        else:
            optimizer.apply(grads, variables)

    steps = _gradient_steps()
    for grads in steps:
        apply(grads)
    graph = apply.get_concrete_function(steps[0]).graph
    op_types = {op.type for op in graph.get_operations()}
    for function in graph._functions.values():  # the branches of Keras's conds
        op_types |= {op.type for op in function.graph.get_operations()}
    return variables, optimizer, op_types


ADAM_KINDS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
    "clipnorm and ema": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.5, use_ema=True,
                                                      ema_overwrite_frequency=2),
    "schedule": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.5)),
    "gradient accumulation": lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("kind", list(ADAM_KINDS))
def test_fused_update_runs_one_kernel_and_matches_keras_adam(kind):
    expected, keras_optimizer, keras_ops = _train(ADAM_KINDS[kind], fused=False)
    got, optimizer, fused_ops = _train(ADAM_KINDS[kind], fused=True)
    assert "ResourceApplyAdam" in fused_ops and "ResourceApplyAdam" not in keras_ops
    assert int(optimizer.iterations) == int(keras_optimizer.iterations)
    # Same formula; Keras rounds 1 - beta in double precision, the kernel in float32:
    # the weights differ by at most 1e-5 of their total update (5 steps of lr 1e-2).
    for a, b in zip(got + optimizer.variables[1:], expected + keras_optimizer.variables[1:]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=5e-7, err_msg=a.path)
    assert "update_step" not in vars(optimizer)


class OwnUpdate(keras.optimizers.Adam):
    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient * 0.5, variable, learning_rate)


SGD_KINDS = {
    "no momentum": (lambda: keras.optimizers.SGD(1e-2), "ResourceApplyGradientDescent"),
    "momentum": (lambda: keras.optimizers.SGD(1e-2, momentum=0.9), "ResourceApplyKerasMomentum"),
    "nesterov": (lambda: keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
                 "ResourceApplyKerasMomentum"),
    "weight decay, clipnorm and a schedule": (lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.5),
        momentum=0.5, weight_decay=0.05, clipnorm=0.5), "ResourceApplyKerasMomentum"),
}


@pytest.mark.parametrize("kind", list(SGD_KINDS))
def test_fused_sgd_runs_one_kernel_and_gives_kerass_weights_bit_for_bit(kind):
    make_optimizer, kernel = SGD_KINDS[kind]
    expected, keras_optimizer, keras_ops = _train(make_optimizer, fused=False)
    got, optimizer, fused_ops = _train(make_optimizer, fused=True)
    assert kernel in fused_ops and kernel not in keras_ops
    # The same float32 operations in the same order: weights and momentum slots equal.
    for a, b in zip(got + optimizer.variables, expected + keras_optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    assert int(optimizer.iterations) == 5 and "update_step" not in vars(optimizer)


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.Adam(1e-2, amsgrad=True), lambda: OwnUpdate(1e-2),
    lambda: keras.optimizers.RMSprop(1e-2, momentum=0.9), lambda: keras.optimizers.Adamax(1e-2)],
    ids=["amsgrad", "own update_step", "rmsprop", "adamax"])
def test_other_optimizers_keep_keras_update(make_optimizer):
    expected, _, _ = _train(make_optimizer, fused=False)
    got, optimizer, fused_ops = _train(make_optimizer, fused=True)
    assert not fused_update.fusable(optimizer)
    assert not {"ResourceApplyAdam", "ResourceApplyKerasMomentum", "ResourceApplyGradientDescent"} & fused_ops
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_sparse_gradient_takes_keras_update_and_dense_ones_the_kernel():
    table = keras.Variable(np.ones((6, 3), "float32"))
    dense = keras.Variable(np.ones((3,), "float32"))
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build([table, dense])
    sparse = tf.IndexedSlices(tf.ones((2, 3)), tf.constant([1, 4]), tf.constant([6, 3]))

    @tf.function
    def apply():
        with fused_update.fused_updates(optimizer):
            optimizer.apply([sparse, tf.ones(3)], [table, dense])

    apply()
    rows = np.asarray(table)
    assert (rows[[1, 4]] < 1).all() and (rows[[0, 2, 3, 5]] == 1).all()  # only the rows seen
    assert "ResourceApplyAdam" in {op.type for op in apply.get_concrete_function().graph.get_operations()}
    np.testing.assert_allclose(np.asarray(dense), 1 - 0.1, rtol=1e-6)  # Adam's first step: lr * sign


def test_the_switch_goes_when_the_block_raises():
    optimizer = keras.optimizers.Adam()
    with pytest.raises(RuntimeError):
        with fused_update.fused_updates(optimizer):
            assert [h.owner for h in patches.installed(optimizer, "update_step")] == ["fused_update"]
            raise RuntimeError("inside")
    assert "update_step" not in vars(optimizer) and not patches.installed(optimizer)
    assert not fused_update.fusable(keras.optimizers.Adam(amsgrad=True))
    assert fused_update.fusable(keras.optimizers.SGD()) and fused_update.fusable(keras.optimizers.AdamW())


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.Adam(1e-3), lambda: keras.optimizers.SGD(1e-2, momentum=0.9)],
    ids=["adam", "sgd"])
def test_fit_under_tfmp_updates_every_variable_on_the_kernel(monkeypatch, make_optimizer):
    calls = []
    fused = fused_update._fused_update_step
    monkeypatch.setattr(fused_update, "_fused_update_step",
                        lambda *args: calls.append(args[4].name) or fused(*args))
    with tfmp.policy_scope("mixed_bfloat16"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(make_optimizer(), "mse")
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
    x = np.ones((8, 4), "float32")
    model.fit(x, np.ones((8, 1), "float32"), batch_size=4, epochs=1, verbose=0)
    names = [v.value.name for v in model.trainable_variables]
    assert calls[:len(names)] == names  # each variable of each trace of the step
    assert len(calls) % len(names) == 0 and set(calls) == set(names)
    assert "update_step" not in vars(model.optimizer.inner_optimizer)
    assert int(model.optimizer.iterations) == 2


def test_benchmark_script_times_both_updates_on_each_models_weights(tmp_path):
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from benchmarks import fused_update as bench

    path = tmp_path / "updates.json"
    bench.main(["--quick", "--models", "mlp", "vit", "--optimizers", "adam", "nesterov",
                "--json", str(path)])
    results = json.loads(path.read_text())
    assert list(results["models"]) == ["mlp", "vit"]
    for name, m in results["models"].items():
        model = bench.workloads(True)[name].build()
        assert m["parameters"] == sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        assert list(m["optimizers"]) == ["adam", "nesterov"]
        for run in m["optimizers"].values():
            assert all(len(run["ms"][v]) == 2 for v in ("keras", "fused"))
            assert run["largest_change"] > 0
        assert 0 <= m["optimizers"]["adam"]["largest_difference"] <= 1e-4 * m["optimizers"]["adam"]["largest_change"]
        assert m["optimizers"]["nesterov"]["largest_difference"] == 0  # SGD's kernel: bit for bit


@pytest.mark.parametrize("kind", ["global_clipnorm", "gradient accumulation over 3"])
def test_where_fused_sgd_differs_from_keras_it_is_grapplers_reordering_of_kerass_ops(kind):
    """With global clipping or accumulation Grappler's arithmetic optimizer may reorder
    Keras's own multiplies and divides (the kernel takes their product as one operand):
    with it off, the fused weights equal Keras's bit for bit."""
    make_optimizer = {
        "global_clipnorm": lambda: keras.optimizers.SGD(5e-2, momentum=0.9, global_clipnorm=0.1),
        "gradient accumulation over 3": lambda: keras.optimizers.SGD(5e-2, gradient_accumulation_steps=3),
    }[kind]
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    try:
        expected, _, _ = _train(make_optimizer, fused=False)
        got, _, fused_ops = _train(make_optimizer, fused=True)
    finally:
        tf.config.optimizer.set_experimental_options(
            {"arithmetic_optimization": before.get("arithmetic_optimization", True)})
    assert {"ResourceApplyKerasMomentum", "ResourceApplyGradientDescent"} & fused_ops
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_optimizer_made_before_enable_without_speedups_keeps_kerass_update(monkeypatch):
    """`enable(speedups=False)` is the model's switch: a tfmp optimizer made before it (with
    fused updates on) is switched off when the model is attached, and its steps never reach
    the fused kernel."""
    calls = []
    monkeypatch.setattr(fused_update, "_fused_update_step", lambda *args: calls.append(args))
    optimizer = tfmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    assert optimizer.fused_updates is True  # made outside any session: the default
    with tfmp.policy_scope("mixed_bfloat16", speedups=False):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(optimizer, "mse")
    assert model.optimizer is optimizer and optimizer.fused_updates is False
    assert tfmp.attachment(model).speedups["fused_update"].startswith("off")
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), batch_size=4, epochs=1, verbose=0)
    assert calls == [] and int(optimizer.iterations) == 2
