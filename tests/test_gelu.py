"""The exact GELU in float32 inside: its values, the per-model decision, the hook.

The decision rests on the machine's facts: a CPU (a Zen 4 made this machine's
with `injected_facts`) takes float32 inside, a GPU machine (an A100) Keras's GELU,
so both branches run on any CPU; no test asserts a time.
"""

import inspect
import math
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from _benchmarks import quick_run
from _traced import forward_and_backward_ops

import tfmp
from tfmp import DeviceFacts, GpuFacts
from tfmp._src.float32 import bias_gradient, gelu
from tfmp._src.keras_hooks import backend_ops, contracts
from tfmp._src.policy.hardware import injected_facts
from _machines import A100, SAPPHIRE_RAPIDS, XEON_NO_BF16, ZEN4

pytestmark = pytest.mark.usefixtures("restore_probe_caches")

X = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
Y = np.random.default_rng(1).integers(0, 3, size=(16,))
T4 = DeviceFacts(gpus=(GpuFacts("Tesla T4", (7, 5)),))
#: The error-function ops of GELU: TensorFlow 2.21's tf.nn.gelu takes Erfc, 2.17's Erf.
ERF = ("Erf", "Erfc")
#: The op types of GELU's forward and backward passes, Keras's or float32 inside (AddN:
#: the gradient summed over GeluBlock's two GELUs of one input; Sum, Reshape, Shape,
#: BroadcastGradientArgs: TensorFlow 2.17's gradient of its broadcasting GELU chain;
#: PartitionedCall, Placeholder: the call of the XLA-compiled gradient and its body's arguments).
GELU_OPS = {"Erf", "Erfc", "Exp", "Mul", "AddV2", "AddN", "Neg", "Cast", "IdentityN", "Identity",
            "Square", "RealDiv", "Sqrt", "Sub", "Pow", "Const", "Sum", "Reshape", "Shape",
            "BroadcastGradientArgs", "PartitionedCall", "Placeholder"}


def _exact(x):
    """GELU and its derivative of float64 values, from math.erfc."""
    erfc = np.vectorize(math.erfc)
    return (0.5 * x * erfc(-x / math.sqrt(2.0)),
            0.5 * erfc(-x / math.sqrt(2.0)) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))


def _value_and_gradient(function, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = function(x)
    return y, tape.gradient(y, x)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_inside_rounds_the_exact_gelu_and_its_gradient_once(dtype):
    x = tf.cast(tf.random.stateless_normal((20000,), seed=(1, 2)) * 3.0, dtype)
    exact, slope = _exact(tf.cast(x, tf.float64).numpy())
    y, grad = _value_and_gradient(gelu.float32_inside, x)
    assert (y.dtype, y.shape, grad.dtype) == (x.dtype, x.shape, x.dtype)
    # Rounded once: within half a unit in the last place of the exact value (and a
    # float32 rounding) wherever the value is normal in `dtype`.
    normal = np.abs(exact) > (1e-30 if dtype == "bfloat16" else 6.2e-5)
    stored_bits = 7 if dtype == "bfloat16" else 10
    ulp = 2.0 ** (np.floor(np.log2(np.abs(exact[normal]))) - stored_bits)
    assert np.all(np.abs(tf.cast(y, tf.float64).numpy()[normal] - exact[normal])
                  <= 0.5 * ulp + 1e-5 * np.abs(exact[normal]))
    keras_y, keras_grad = _value_and_gradient(lambda v: tf.nn.gelu(v, approximate=False), x)
    error = lambda t, ref: np.abs(tf.cast(t, tf.float64).numpy() - ref).mean()  # noqa: E731
    assert error(y, exact) < error(keras_y, exact)  # Keras's chain rounds after each op
    assert error(grad, slope) <= error(keras_grad, slope)
    np.testing.assert_allclose(tf.cast(grad, tf.float64).numpy(), slope, rtol=2.0**-7, atol=2.0**-7)


def test_float32_inside_has_a_second_derivative():
    """A gradient penalty differentiates the GELU's gradient again."""
    x = tf.constant([-2.0, -0.5, 0.0, 0.7, 3.0], tf.bfloat16)
    with tf.GradientTape() as outer:
        outer.watch(x)
        _, grad = _value_and_gradient(gelu.float32_inside, x)
        penalty = tf.reduce_sum(tf.cast(grad, tf.float32))
    second = outer.gradient(penalty, x)
    assert second is not None
    value = tf.cast(x, tf.float64).numpy()
    exact = (2.0 - value * value) * np.exp(-0.5 * value * value) / math.sqrt(2.0 * math.pi)
    np.testing.assert_allclose(tf.cast(second, tf.float64).numpy(), exact, atol=0.02)


def test_the_gradient_is_fused_by_xla_only_where_the_shape_past_the_batch_is_known():
    """A known shape compiles once per batch size; a varying sequence length would compile
    at every new length, so it takes TensorFlow's ops."""
    x = tf.cast(tf.random.stateless_normal((4, 6, 8), seed=(3, 4)) * 3.0, tf.bfloat16)
    dy = tf.cast(tf.random.stateless_normal((4, 6, 8), seed=(5, 6)), tf.bfloat16)
    gradients, fused_calls = {}, {}
    for name, shape in {"known": (None, 6, 8), "varying length": (None, None, 8)}.items():
        @tf.function(input_signature=[tf.TensorSpec(shape, tf.bfloat16)] * 2)
        def backward(x, dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = gelu.float32_inside(x)
            return tape.gradient(y, x, output_gradients=dy)

        graph = backward.get_concrete_function().graph
        fused_calls[name] = sum(op.node_def.attr["_XlaMustCompile"].b for op in graph.get_operations())
        gradients[name] = tf.cast(backward(x, dy), tf.float64).numpy()
    assert fused_calls == {"known": 1, "varying length": 0}
    _, slope = _exact(tf.cast(x, tf.float64).numpy())
    expected = slope * tf.cast(dy, tf.float64).numpy()
    for found in gradients.values():  # each rounded once from float32: within one bfloat16 step
        np.testing.assert_allclose(found, expected, rtol=2.0**-7, atol=1e-30)


def test_the_decision_rests_on_the_machine_facts_and_measures_nothing(monkeypatch):
    monkeypatch.setattr(gelu, "measure", lambda *a, **k: pytest.fail("measured"))
    for facts in (ZEN4, SAPPHIRE_RAPIDS, XEON_NO_BF16):  # every CPU: Eigen's bfloat16 elementwise ops
        assert gelu.decision("bfloat16", facts) == f"float32 inside: {gelu.RULE}"
        assert gelu.decision("float32", facts) == gelu.decision("float16", facts) == gelu.KERAS
    assert gelu.decision("bfloat16", T4) == gelu.decision("bfloat16", A100) == gelu.KERAS
    with injected_facts(A100):
        assert gelu.decision("bfloat16") == gelu.KERAS
    with injected_facts(ZEN4):
        assert gelu.decision("bfloat16").startswith(gelu.FLOAT32_INSIDE)


def test_the_measurement_times_both_variants_on_this_cpu():
    found = gelu.measure("bfloat16", budget_s=0.05, repeats=3, shape=(64, 16, 128))
    assert found.source == "measured" and found.keras_ms > 0 and found.float32_ms > 0
    assert math.isfinite(found.ratio) and found.faster == (found.ratio >= gelu.FASTER_RATIO)


def test_a_measurement_asked_while_tracing_fails_without_timing():
    found = tf.function(lambda: tf.constant(gelu.measure("bfloat16").source == gelu.TRACING))()
    assert bool(found)


class GeluBlock(keras.layers.Layer):
    """A custom layer as keras.io writes them: keras.activations.gelu and keras.ops.gelu."""

    def call(self, x):
        return keras.activations.gelu(x) + keras.ops.gelu(x)  # exact, then tanh (ops' default)


def _build():
    inputs = keras.Input((8,))
    x = keras.layers.Dense(32, activation="gelu")(inputs)
    x = keras.layers.Activation("gelu")(keras.layers.Dense(16)(x))
    x = GeluBlock()(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _op_counts(model):
    return forward_and_backward_ops(model, tf.constant(X), tf.constant(Y))


def _gelus_in_float32(model):
    """``(forward, backward)`` of the model's traced step: exact GELUs computed in float32
    (a float32 Erf or Erfc outside the fused gradient's body), and calls of the
    XLA-compiled `gelu.fused_gradient`."""
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x, y, model(x, training=True), training=True)
        return tape.gradient(loss, model.trainable_variables)

    graph = tf.function(step).get_concrete_function(tf.constant(X), tf.constant(Y)).graph
    everything = [graph] + [f.graph for f in graph._functions.values()]
    fused = [op.get_attr("f").name for g in everything for op in g.get_operations()
             if op.type == "PartitionedCall" and op.node_def.attr["_XlaMustCompile"].b]
    outside = [graph] + [f.graph for name, f in graph._functions.items() if name not in fused]
    forward = sum(op.type in ERF and op.outputs[0].dtype == tf.float32 for g in outside for op in g.get_operations())
    return forward, len(fused)


def _erf(counts, dtype):
    """Error-function ops (Erf or Erfc) of `dtype` among `counts`."""
    return sum(counts[f"{op}:{dtype}"] for op in ERF)


def _tfmp_model(faster):
    """An attached bfloat16 `_build()` model; its bias gradients are Keras's (only the GELU differs).

    `faster`: on a CPU (a Zen 4), where float32 inside is taken; else on a GPU machine (an A100).
    """
    with tfmp.policy_scope("mixed_bfloat16"), injected_facts(ZEN4 if faster else A100), \
            bias_gradient.injected(loses=False):
        return _build()


def test_where_the_16_bit_gelu_is_slow_a_model_computes_its_exact_gelus_in_float32_only():
    keras.config.set_dtype_policy("mixed_bfloat16")  # restored by the conftest fixture
    plain = _build()
    keras.config.set_dtype_policy("float32")
    model = _tfmp_model(faster=True)
    assert tfmp.attachment(model).gelu == f"float32 inside: {gelu.RULE}"
    ops, keras_ops = _op_counts(model), _op_counts(plain)
    # Three exact GELUs (Dense, Activation, keras.activations.gelu), each with an Erfc
    # forward in float32 and its backward by the XLA-compiled gradient (Keras's backward
    # differentiates its erf or erfc with an Exp); the tanh GELU of keras.ops.gelu stays
    # in bfloat16, as Keras has it.
    assert _gelus_in_float32(model) == (3, 3)
    assert _erf(ops, "bfloat16") == 0 and _erf(keras_ops, "bfloat16") == 3
    assert ops["Tanh:bfloat16"] == keras_ops["Tanh:bfloat16"] > 0
    differing = {key.split(":")[0] for key in ops.keys() | keras_ops.keys() if ops[key] != keras_ops[key]}
    assert differing <= GELU_OPS
    plain.set_weights(model.get_weights())
    np.testing.assert_allclose(model(X).numpy(), tf.cast(plain(X), tf.float32).numpy(), rtol=0.05, atol=0.05)
    activation = next(layer for layer in model.layers if isinstance(layer, keras.layers.Activation))
    hidden = tf.constant(X[:, :4].repeat(4, axis=1), tf.bfloat16)
    assert activation(hidden).dtype == tf.bfloat16  # called alone: its own attachment, Keras's dtype
    history = model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    assert all(math.isfinite(loss) for loss in history.history["loss"])


def test_where_it_is_not_slow_the_model_traces_kerass_gelu():
    model = _tfmp_model(faster=False)
    assert tfmp.attachment(model).gelu == gelu.KERAS
    assert _gelus_in_float32(model) == (0, 0)


def test_the_decision_stays_with_the_model_in_any_thread_and_detach_gives_keras_back():
    model = _tfmp_model(faster=True)
    seen = []
    with injected_facts(A100):  # what the machine says later does not matter
        thread = threading.Thread(target=lambda: seen.append(_gelus_in_float32(model)))
        thread.start()
        thread.join()
        keras.config.set_dtype_policy("mixed_bfloat16")
        plain = _build()  # compiled without tfmp while the hook is on: Keras's GELU
        keras.config.set_dtype_policy("float32")
        assert _gelus_in_float32(plain) == (0, 0)
    assert seen == [(3, 3)]
    tfmp.detach(model)
    assert _erf(_op_counts(model), "bfloat16") == 3 and _gelus_in_float32(model) == (0, 0)


def test_an_attached_model_keeps_its_gelu_inside_a_model_tfmp_did_not_attach():
    inner = _tfmp_model(faster=True)
    inputs = keras.Input((8,))
    outer = keras.Model(inputs, inner(inputs))  # built and called without tfmp
    assert tfmp.attachment(outer) is None
    x = tf.constant(X)
    graph = tf.function(lambda v: outer(v, training=True)).get_concrete_function(x).graph
    graphs = [graph] + [f.graph for f in graph._functions.values()]
    erf = [op.outputs[0].dtype for g in graphs for op in g.get_operations() if op.type in ERF]
    assert erf == [tf.float32] * 3


def test_a_layer_detached_from_an_attached_model_computes_kerass_gelu():
    model = _tfmp_model(faster=True)
    dense = next(layer for layer in model.layers if getattr(layer, "activation", None) is not None
                 and "gelu" in getattr(layer.activation, "__name__", ""))
    tfmp.detach(dense)
    assert _erf(_op_counts(model), "bfloat16") == 1
    assert _gelus_in_float32(model) == (2, 2)  # the other two: float32 inside


def test_a_gelu_outside_a_layer_call_is_kerass():
    model = _tfmp_model(faster=True)
    x = tf.constant([0.5, -1.0], tf.bfloat16)
    graph = tf.function(lambda v: keras.activations.gelu(v)).get_concrete_function(x).graph
    assert {op.get_attr("T") for op in graph.get_operations() if op.type in ERF} == {tf.bfloat16}
    assert tfmp.attachment(model) is not None


def test_keras_still_calls_the_backend_gelu_by_module_attribute():
    """The contract the hook rests on: ``gelu(x, approximate)`` looked up on ``backend.nn``."""
    assert list(inspect.signature(backend_ops.backend_nn().gelu).parameters) == ["x", "approximate"]
    assert any("backend.nn" in row for row, _ in contracts.CALL_ORDER)


def test_the_benchmark_runs_and_its_tables_hang_together(tmp_path):
    benchmark, written = quick_run("gelu", tmp_path)
    assert [(row["shape"], row["dtype"]) for row in written["timings"]] == [
        ("tiny", "bfloat16"), ("tiny", "float16")]
    for row in written["timings"]:
        assert row["fastest_ratio"] == pytest.approx(row["keras_ms"] / row["float32_inside_ms"])
        taken = row["fastest_ratio"] >= gelu.FASTER_RATIO and row["dtype"] == "bfloat16"
        assert row["taken"] == taken and row["paired_ratio"] > 0
    errors = {(row["dtype"], row["variant"]): row for row in written["errors"]}
    assert len(errors) == 4 and all(row["values"] == benchmark.QUICK_VALUES for row in errors.values())
    for dtype in ("bfloat16", "float16"):
        ours, keras_ = errors[(dtype, "float32 inside")], errors[(dtype, "Keras (16-bit chain)")]
        assert ours["forward_mean"] < keras_["forward_mean"] and ours["gradient_max"] < 0.02
    text = benchmark.markdown(written)
    assert "| tiny (16 x 8 x 32) | bfloat16 |" in text and "| float16 | float32 inside |" in text


def test_detaching_a_sub_model_retraces_the_attached_model_holding_it():
    with tfmp.policy_scope("mixed_bfloat16"):
        sub = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="gelu")])
        outer = keras.Sequential([keras.Input((8,)), sub, keras.layers.Dense(2)])
        with injected_facts(ZEN4):
            outer.compile("adam", "mse")
    outer.fit(X, X[:, :2], batch_size=8, verbose=0)
    assert outer.train_function is not None
    tfmp.detach(sub)
    assert outer.train_function is None and tfmp.attachment(outer) is not None
    assert _erf(forward_and_backward_ops(outer, tf.constant(X), tf.constant(X[:, :2])), "bfloat16") == 1


def test_a_float32_model_holding_bfloat16_layers_is_decided_by_its_layers():
    """As a model saved under plain mixed_bfloat16 and loaded before enable() comes back."""
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="gelu", dtype="mixed_bfloat16")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(hidden))
    with tfmp.policy_scope("mixed_bfloat16"), injected_facts(ZEN4):
        with pytest.warns(tfmp.PerformanceWarning, match=r"its layers compute in bfloat16 \(1\), float32 \(1\)"):
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert tfmp.attachment(model).gelu.startswith("float32 inside")
    assert _gelus_in_float32(model) == (1, 1)
