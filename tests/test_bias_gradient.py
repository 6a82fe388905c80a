"""16-bit bias gradients summed with float32 accumulation: TensorFlow's kernel, the decision, the hook.

Whether this CPU's ``BiasAddGrad`` loses a bfloat16 sum is checked by the real
kernels in the first test; the model tests inject the decision
(`bias_gradient.injected`) and compare real gradients. No test asserts a time.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _premises import conv2d_bias_gradient_is_fused
from _traced import forward_and_backward_ops

import tfmp
from tfmp import DeviceFacts, GpuFacts
from tfmp._src.attachment import hooks as attachment_hooks
from tfmp._src.float32 import bias_gradient

pytestmark = pytest.mark.usefixtures("restore_probe_caches")

T4 = DeviceFacts(gpus=(GpuFacts("Tesla T4", (7, 5)),))
#: The value of every output gradient in the gradient tests, and the same rounded to bfloat16.
SCALE = 0.01
SCALE_BF16 = float(tf.cast(tf.constant(SCALE, tf.bfloat16), tf.float64))
#: Op types a summed bias gradient may add or drop against Keras's graph (the custom
#: gradient's IdentityN, the Sum and the Reshape to the bias's shape, their shape inputs,
#: Fill: the zeros TensorFlow's gradient code makes for the IdentityN's other outputs).
BIAS_GRADIENT_OPS = {"BiasAddGrad", "Sum", "Reshape", "Shape", "IdentityN", "Const", "Range", "Identity", "Fill"}


def test_tensorflow_s_cpu_kernel_loses_a_bfloat16_bias_sum_that_sum_keeps():
    """The behaviour tfmp works around, on TensorFlow 2.17 and 2.21: if a release accumulates
    BiasAddGrad in float32 this fails and the docs need updating. A traced Conv2D's bias
    gradient is exact only where oneDNN fuses it with the filter's (`conv2d_bias_gradient_is_fused`),
    and the decision follows what was measured."""
    bf16, f16 = bias_gradient.measure("bfloat16"), bias_gradient.measure("float16")
    fused = conv2d_bias_gradient_is_fused()
    assert bf16.exact == pytest.approx(bias_gradient.ROWS * SCALE_BF16)
    assert bf16.summed == bf16.exact  # Sum accumulates in float32
    assert (bf16.conv2d == bf16.exact) is fused  # and so does oneDNN's fused Conv2D kernel
    assert f16.bias_add_grad == pytest.approx(f16.exact, rel=2.0**-10)  # and BiasAddGrad float16
    assert bf16.bias_add_grad < 0.2 * bf16.exact  # stalls where half an ulp of the sum exceeds 0.01
    assert bf16.kernel_loses_it and bf16.conv2d_loses_it is not fused and not f16.kernel_loses_it
    assert bias_gradient.decision("bfloat16") == (
        f"{'summed except after Conv2D' if fused else 'summed'}: 4096 rows of 0.01 in bfloat16: "
        f"BiasAddGrad 4, Sum 41, traced Conv2D {41 if fused else 4}, exact 41 (measured)")
    assert bias_gradient.decision("float16").startswith("keras: 4096 rows of 0.01 in float16")


def test_the_decision_checks_only_a_16_bit_model_on_a_cpu(monkeypatch):
    monkeypatch.setattr(bias_gradient, "measure", lambda dtype: pytest.fail("checked"))
    bias_gradient._cache.clear()
    assert bias_gradient.decision("float32") == bias_gradient.KERAS
    assert bias_gradient.decision("bfloat16", T4) == bias_gradient.KERAS
    with bias_gradient.injected(loses=False):
        assert bias_gradient.decision("bfloat16").startswith("keras: 4096 rows of 0.01 in bfloat16")


def test_the_check_runs_eagerly_while_a_step_is_traced():
    """So a layer attached at its first call, inside a traced step, gets the decision too."""
    bias_gradient._cache.clear()
    source = tf.function(lambda: tf.constant(bias_gradient.probe("bfloat16").source))()
    assert source.numpy() == b"measured" and bias_gradient._cache["bfloat16"].source == "measured"


def _hidden_and_model(make_layer, shape):
    """A bfloat16 model whose first layer (`make_layer()`) keeps its bfloat16 output."""
    inputs = keras.Input(shape)
    hidden = make_layer()
    x = keras.layers.Flatten()(hidden(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile("adam", "mse")
    return hidden, model


def _bias_gradient(layer, x):
    """The bias gradient of ``sum(scale * layer(x))`` with ``scale`` 0.01 everywhere, fed in
    (a constant output gradient would be folded by Grappler): every output gradient is
    0.01 in bfloat16. Returns it and the number of rows summed."""
    @tf.function
    def gradients(x, scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(x), tf.float32) * scale)
        return tape.gradient(loss, layer.trainable_weights)  # the kernel's too, as in a step

    out_shape = layer.compute_output_shape(x.shape)
    bias = gradients(x, tf.fill(out_shape, SCALE))[-1].numpy()
    return bias, int(np.prod(out_shape)) // bias.shape[0]


#: Layers whose bias gradient Keras computes with BiasAddGrad alone: (make, input shape, batch).
LOSING = {
    "Dense": (lambda: keras.layers.Dense(4), (16,), (2048, 16)),
    "Dense on a sequence": (lambda: keras.layers.Dense(4), (64, 16), (32, 64, 16)),
    "Conv1D": (lambda: keras.layers.Conv1D(4, 3, padding="same"), (64, 3), (32, 64, 3)),
    "Conv3D": (lambda: keras.layers.Conv3D(4, 3, padding="same"), (4, 8, 8, 3), (8, 4, 8, 8, 3)),
    "DepthwiseConv2D": (lambda: keras.layers.DepthwiseConv2D(3, padding="same"), (16, 16, 4), (8, 16, 16, 4)),
}
#: A Conv2D, whose bias gradient oneDNN computes with its filter's (exact).
CONV2D = (lambda: keras.layers.Conv2D(4, 3, padding="same"), (16, 16, 3), (8, 16, 16, 3))


def _plain_and_tfmp(make_layer, shape, conv2d_loses=False):
    """The same bfloat16 layer in a plain Keras model and in one tfmp attached (same weights)."""
    keras.config.set_dtype_policy("mixed_bfloat16")  # restored by the conftest fixture
    plain, _ = _hidden_and_model(make_layer, shape)
    keras.config.set_dtype_policy("float32")
    with tfmp.policy_scope("mixed_bfloat16"), bias_gradient.injected(loses=True, conv2d_loses=conv2d_loses):
        hidden, model = _hidden_and_model(make_layer, shape)
    assert hidden.compute_dtype == "bfloat16"
    hidden.set_weights(plain.get_weights())
    return plain, hidden, model


@pytest.mark.parametrize("kind", list(LOSING))
def test_an_attached_bfloat16_layer_gets_its_exact_bias_gradient_where_keras_loses_it(kind):
    make_layer, shape, batch = LOSING[kind]
    x = tf.constant(np.random.default_rng(0).normal(size=batch).astype("float32"))
    plain, hidden, model = _plain_and_tfmp(make_layer, shape)
    assert tfmp.attachment(model).bias_gradient.startswith("summed except after Conv2D: 4096 rows")
    ours, rows = _bias_gradient(hidden, x)
    keras_gradient, _ = _bias_gradient(plain, x)
    exact = rows * SCALE_BF16  # 2,048 to 8,192 rows of 0.01
    # Rounded once to bfloat16 from a float32 sum: within half an ulp and float32 slack.
    np.testing.assert_allclose(ours, exact, rtol=2.0**-8 + 1e-5)
    assert np.all(np.abs(keras_gradient - exact) > 0.5 * exact)  # Keras's: lost


def test_a_conv2d_with_a_frozen_filter_gets_its_exact_bias_gradient_where_keras_loses_it():
    """Bias-only fine-tuning: no filter gradient for oneDNN to fuse the bias's with."""
    make_layer, shape, batch = CONV2D
    x = tf.constant(np.random.default_rng(0).normal(size=batch).astype("float32"))
    plain, hidden, _ = _plain_and_tfmp(make_layer, shape)
    plain.kernel.trainable = hidden.kernel.trainable = False
    (ours, rows), (keras_gradient, _) = _bias_gradient(hidden, x), _bias_gradient(plain, x)
    np.testing.assert_allclose(ours, rows * SCALE_BF16, rtol=2.0**-8 + 1e-5)
    assert np.all(np.abs(keras_gradient - rows * SCALE_BF16) > 0.5 * rows * SCALE_BF16)


def test_a_conv2d_s_bias_gradient_is_exact_from_onednns_fused_kernel_or_tfmps_sum():
    """Where oneDNN fuses a Conv2D's bias gradient, tfmp keeps Keras's (exact); elsewhere it
    sums it (the decision measured here, injected as this machine's premise)."""
    make_layer, shape, batch = CONV2D
    x = tf.constant(np.random.default_rng(0).normal(size=batch).astype("float32"))
    fused = conv2d_bias_gradient_is_fused()
    plain, hidden, _ = _plain_and_tfmp(make_layer, shape, conv2d_loses=not fused)
    (ours, rows), (keras_gradient, _) = _bias_gradient(hidden, x), _bias_gradient(plain, x)
    np.testing.assert_allclose(ours, rows * SCALE_BF16, rtol=2.0**-8 + 1e-5)
    assert np.array_equal(ours, keras_gradient) is fused


def _ops(model, x, y):
    return forward_and_backward_ops(model, tf.constant(x), tf.constant(y))


def _mlp_and_cnn():
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    x = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(x))
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


X = np.random.default_rng(1).normal(size=(16, 8, 8, 3)).astype("float32")
Y = np.random.default_rng(2).integers(0, 3, size=(16,))


def test_only_the_bias_gradients_differ_from_kerass_graph():
    keras.config.set_dtype_policy("mixed_bfloat16")
    plain = _mlp_and_cnn()
    keras.config.set_dtype_policy("float32")
    with tfmp.policy_scope("mixed_bfloat16"), bias_gradient.injected(loses=True):
        summed = _mlp_and_cnn()
    with tfmp.policy_scope("mixed_bfloat16"), bias_gradient.injected(loses=False):
        kept = _mlp_and_cnn()
    ops, keras_ops, kept_ops = _ops(summed, X, Y), _ops(plain, X, Y), _ops(kept, X, Y)
    # Three bfloat16 biases (Conv2D, Dense, and the logits Dense, whose matmul and bias
    # stay 16-bit under tfmp's logits rule); the Conv2D's gradient stays oneDNN's.
    assert keras_ops["BiasAddGrad:bfloat16"] == kept_ops["BiasAddGrad:bfloat16"] == 3
    assert ops["BiasAddGrad:bfloat16"] == 1 and ops["BiasAdd:bfloat16"] == kept_ops["BiasAdd:bfloat16"] == 3
    with tfmp.policy_scope("mixed_bfloat16"), bias_gradient.injected(loses=True, conv2d_loses=True):
        everything = _mlp_and_cnn()
    assert tfmp.attachment(everything).bias_gradient.startswith("summed: ")
    assert _ops(everything, X, Y)["BiasAddGrad:bfloat16"] == 0
    differing = {key.split(":")[0] for key in ops.keys() | kept_ops.keys() if ops[key] != kept_ops[key]}
    assert differing <= BIAS_GRADIENT_OPS
    history = summed.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    kept.set_weights(summed.get_weights())
    np.testing.assert_array_equal(summed.predict(X, verbose=0), kept.predict(X, verbose=0))


def test_the_decision_stays_with_the_layer_and_detach_gives_kerass_gradient_back():
    with tfmp.policy_scope("mixed_bfloat16"), bias_gradient.injected(loses=True):
        model = _mlp_and_cnn()
    inputs = keras.Input((8, 8, 3))
    outer = keras.Model(inputs, model(inputs))  # called without tfmp: the inner layers keep theirs
    outer.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert tfmp.attachment(outer) is None
    assert _ops(outer, X, Y)["BiasAddGrad:bfloat16"] == 1  # the Conv2D's
    tfmp.detach(model)
    assert _ops(model, X, Y)["BiasAddGrad:bfloat16"] == 3


def test_a_float32_model_and_a_bias_add_outside_a_layer_are_kerass():
    with tfmp.policy_scope("float32"):
        model = _mlp_and_cnn()
    assert tfmp.attachment(model).bias_gradient == bias_gradient.KERAS
    with tfmp.policy_scope("mixed_bfloat16"), bias_gradient.injected(loses=True):
        alive = _mlp_and_cnn()
    assert tfmp.attachment(alive).bias_gradient.startswith("summed")
    x, bias = tf.ones((4, 3), tf.bfloat16), tf.ones((3,), tf.bfloat16)
    with tfmp.step_scope(alive):  # the hook on, as in the model's step
        assert "bias_gradient" in {hook.owner for hook in attachment_hooks.installed()}
        graph = tf.function(lambda a, b: keras.ops.add(a, b)).get_concrete_function(x, bias).graph
    assert "BiasAdd" in {op.type for op in graph.get_operations()}
    assert not any(op.type == "IdentityN" for op in graph.get_operations())


def test_keras_still_calls_the_backend_add_by_module_attribute():
    """The contract the hook relies on: ``keras.ops.add`` reads ``backend.numpy.add`` at each call."""
    from tfmp._src.keras_hooks import backend_ops

    seen = []
    module = backend_ops.backend_numpy()
    original = module.add
    module.add = lambda x1, x2: seen.append(1) or original(x1, x2)
    try:
        keras.layers.Dense(2)(tf.ones((1, 3)))
    finally:
        module.add = original
    assert seen == [1]


@pytest.mark.parametrize("x_shape, bias_shape, axis", [
    ((4, 3), (3,), 1), ((2, 5, 3), (3,), 2), ((2, 5, 5, 3), (1, 1, 1, 3), 3),
    ((2, 3, 5, 5), (1, 3, 1, 1), 1), ((4, 3), (4, 3), None), ((4, 3), (4, 1), None), ((3,), (3,), None),
])
def test_channel_axis_is_where_keras_adds_with_bias_add(x_shape, bias_shape, axis):
    x, bias = tf.zeros(x_shape, tf.bfloat16), tf.zeros(bias_shape, tf.bfloat16)
    assert bias_gradient.channel_axis(x, bias) == axis
    graph = tf.function(lambda a, b: keras.ops.add(a, b)).get_concrete_function(x, bias).graph
    assert ("BiasAdd" in {op.type for op in graph.get_operations()}) == (axis is not None)
