"""float16 convolutions in float32 inside: values, gradients, the per-model decision, the hook.

The decision rests on the machine's facts: on a CPU (a Zen 4 or a Sapphire Rapids
made this machine's with `injected_facts`) a float16 model's convolutions compute
in float32 inside, its depthwise ones only where TensorFlow's oneDNN takes float16
(the Sapphire Rapids), on a GPU machine (an A100) they stay Keras's, so every branch
runs on any CPU; no test asserts a time (benchmarks/float16_cpu.py measures).
"""

import inspect
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _machines import A100, SAPPHIRE_RAPIDS, SAPPHIRE_RAPIDS_NO_ONEDNN, XEON_NO_BF16, ZEN3, ZEN4
from _premises import channels_first_conv_trains, require
from _traced import forward_and_backward_ops

import tfmp
from tfmp._src.float32 import conv
from tfmp._src.keras_hooks import backend_ops, contracts
from tfmp._src.policy.hardware import injected_facts

X = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype("float32")
Y = np.random.default_rng(1).integers(0, 3, size=(4,))
CONV_OPS = ("Conv1D", "Conv2D", "Conv3D", "Conv2DBackpropInput", "Conv2DBackpropFilter",
            "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2")
DEPTHWISE_OPS = ("DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
                 "DepthwiseConv2dNativeBackpropFilter")


def _build():
    """Conv2D, Conv2DTranspose and a Conv1D over rows, then a float32 head (logits)."""
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same")(x)
    x = keras.layers.Reshape((16, 64))(x)
    x = keras.layers.Conv1D(8, 3, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(x)))
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _attached(facts):
    with injected_facts(facts), warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # float16 on a CPU
        with tfmp.policy_scope("mixed_float16"):
            return _build()


def _conv_ops(model, ops=CONV_OPS):
    """Counts of `ops` (op types) in a traced forward and backward pass, by dtype."""
    counts = forward_and_backward_ops(model, tf.constant(X), tf.constant(Y))
    found = {}
    for key, count in counts.items():
        op, _, dtype = key.partition(":")
        if op in ops:
            found[dtype] = found.get(dtype, 0) + count
    return found


def test_the_decision_rests_on_the_machine_facts_and_only_float16_changes():
    for facts in (ZEN4, SAPPHIRE_RAPIDS, XEON_NO_BF16):
        assert conv.decision("float16", facts) == f"float32 inside: {conv.RULE}"
        assert conv.decision("bfloat16", facts) == conv.decision("float32", facts) == conv.KERAS
    assert conv.decision("float16", A100) == conv.KERAS
    with injected_facts(ZEN4):
        assert conv.decision("float16").startswith(conv.FLOAT32_INSIDE)


def test_depthwise_convolutions_take_float32_inside_only_where_oneDNN_takes_float16():
    assert conv.depthwise_decision("float16", SAPPHIRE_RAPIDS) == f"float32 inside: {conv.DEPTHWISE_RULE}"
    for facts in (ZEN4, ZEN3, XEON_NO_BF16, SAPPHIRE_RAPIDS_NO_ONEDNN):  # Eigen's float16 kernels
        assert conv.depthwise_decision("float16", facts) == f"keras: {conv.DEPTHWISE_KEPT}"
    for facts in (SAPPHIRE_RAPIDS, ZEN4):
        assert conv.depthwise_decision("bfloat16", facts) == conv.depthwise_decision("float32", facts) == conv.KERAS
    assert conv.depthwise_decision("float16", A100) == conv.KERAS
    with injected_facts(SAPPHIRE_RAPIDS):
        assert conv.depthwise_decision("float16").startswith(conv.FLOAT32_INSIDE)


#: Backend convolution (its arguments after the tensors) and operand shapes, per case.
CASES = {
    "conv": ("conv", (1, "same"), [(2, 6, 6, 5), (3, 3, 5, 4)]),
    "conv_transpose": ("conv_transpose", (2, "same"), [(2, 6, 6, 5), (3, 3, 4, 5)]),
    "depthwise_conv": ("depthwise_conv", (1, "same"), [(2, 6, 6, 5), (3, 3, 5, 2)]),
    "depthwise_conv_1d": ("depthwise_conv", (2, "valid"), [(2, 9, 5), (3, 5, 1)]),
    "separable_conv": ("separable_conv", (1, "same"), [(2, 6, 6, 5), (3, 3, 5, 2), (1, 1, 10, 4)]),
    "separable_conv_1d": ("separable_conv", (1, "valid"), [(2, 9, 5), (3, 5, 1), (1, 5, 4)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_are_the_float32_ones_rounded_once(case):
    name, args, shapes = CASES[case]
    rng = np.random.default_rng(2)
    operands = [tf.constant(rng.normal(size=shape) / (1.0 if i == 0 else 4.0), tf.float16)
                for i, shape in enumerate(shapes)]
    function = getattr(backend_ops.backend_nn(), name)

    def convolve(*tensors):
        return function(*tensors, *args)

    with tf.GradientTape() as tape:
        tape.watch(operands)
        y = conv.float32_inside(convolve, *operands)
    dy = tf.constant(rng.normal(size=y.shape), tf.float16)
    grads = tape.gradient(y, operands, output_gradients=dy)
    # the reference: Keras's float32 convolution and TensorFlow's float32 gradients of the
    # same float16 values, each rounded once to float16
    wide = [tf.cast(t, tf.float32) for t in operands]
    with tf.GradientTape() as tape:
        tape.watch(wide)
        y32 = convolve(*wide)
    grads32 = tape.gradient(y32, wide, output_gradients=tf.cast(dy, tf.float32))
    assert [t.dtype for t in (y, *grads)] == [tf.float16] * (1 + len(operands))
    for found, reference in zip((y, *grads), (y32, *grads32)):
        np.testing.assert_array_equal(found.numpy(), tf.cast(reference, tf.float16).numpy())


def test_a_float16_model_on_a_cpu_convolves_in_float32_only():
    model = _attached(ZEN4)
    assert tfmp.attachment(model).conv == f"float32 inside: {conv.RULE}"
    found = _conv_ops(model)
    assert found.get("float16", 0) == 0 and found["float32"] >= 7  # forward and both gradients
    keras.config.set_dtype_policy("mixed_float16")  # restored by the conftest fixture
    plain = _build()
    keras.config.set_dtype_policy("float32")
    assert _conv_ops(plain).get("float32", 0) == 0  # plain Keras: float16 kernels
    plain.set_weights(model.get_weights())
    np.testing.assert_allclose(model(X).numpy(), tf.cast(plain(X), tf.float32).numpy(), rtol=0.02, atol=0.02)
    history = model.fit(X, Y, batch_size=2, epochs=2, verbose=0)
    assert all(math.isfinite(loss) for loss in history.history["loss"])


def _depthwise_model():
    """A SeparableConv2D, then a DepthwiseConv2D and a SeparableConv1D, then a float32 head (logits)."""
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.SeparableConv2D(4, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same")(x)
    x = keras.layers.SeparableConv1D(4, 3)(keras.layers.Reshape((64, 8))(x))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(x)))
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("facts", [SAPPHIRE_RAPIDS, ZEN4], ids=["sapphire_rapids", "zen4"])
def test_separable_convolutions_take_float32_inside_on_a_cpu_depthwise_ones_where_the_facts_say(facts):
    with injected_facts(facts), warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        with tfmp.policy_scope("mixed_float16"):
            model = _depthwise_model()
    found = tfmp.attachment(model)
    assert found.conv == f"float32 inside: {conv.RULE}"
    assert found.depthwise_conv == conv.depthwise_decision("float16", facts)
    counts = forward_and_backward_ops(model, tf.constant(X), tf.constant(Y))
    float16_ops = {key: count for key, count in counts.items()
                   if key.partition(":")[0] in CONV_OPS + DEPTHWISE_OPS and key.endswith(":float16")}
    # the separable layers' depthwise and pointwise halves in float32; the DepthwiseConv2D
    # layer's forward op and both gradients too, or in float16 where its field says keras
    kept = {} if facts.onednn_float16 else {f"{op}:float16": 1 for op in DEPTHWISE_OPS}
    assert float16_ops == kept
    assert counts["DepthwiseConv2dNative:float32"] >= 2 and counts["Conv2D:float32"] >= 2
    keras.config.set_dtype_policy("float32")  # restored by the conftest fixture
    reference = _depthwise_model()
    reference.set_weights(model.get_weights())
    np.testing.assert_allclose(model(X).numpy(), reference(X).numpy(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("facts", [SAPPHIRE_RAPIDS, ZEN4], ids=["sapphire_rapids", "zen4"])
def test_the_audit_says_which_float16_convolutions_compute_in_float32_inside(facts):
    with injected_facts(facts), warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        with tfmp.policy_scope("mixed_float16"):
            model = _depthwise_model()
            rows = {row.class_name: row for row in tfmp.audit(model).rows}
    assert rows["SeparableConv2D"].why == rows["SeparableConv1D"].why == "float32 inside tfmp (Attachment.conv)"
    depthwise = "float32 inside tfmp (Attachment.depthwise_conv)" if facts.onednn_float16 else ""
    assert rows["DepthwiseConv2D"].why == depthwise
    assert all(rows[name].compute_dtype == "float16" for name in ("SeparableConv2D", "DepthwiseConv2D"))
    with injected_facts(facts):
        plain = _depthwise_model()  # float32: nothing inside
    assert all(not row.why for row in tfmp.audit(plain).rows if "Conv" in row.class_name)


def test_on_a_gpu_machine_the_model_keeps_kerass_convolutions():
    model = _attached(A100)
    assert tfmp.attachment(model).conv == conv.KERAS
    assert _conv_ops(model).get("float32", 0) == 0


def test_a_custom_loop_gets_it_and_detach_gives_keras_back():
    model = _attached(ZEN4)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(model(x, training=True), tf.float32))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(tf.constant(X)).graph
    types = {(op.type, op.outputs[0].dtype.name) for op in graph.get_operations() if op.type in CONV_OPS}
    assert types and all(dtype == "float32" for _, dtype in types)
    tfmp.detach(model)
    assert _conv_ops(model).get("float32", 0) == 0


def test_a_second_derivative_goes_through_it():
    model = _attached(ZEN4)
    x = tf.constant(X)
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(tf.cast(model(x), tf.float32) ** 2)
        penalty = tf.reduce_sum(tf.cast(inner.gradient(y, x), tf.float32) ** 2)
    grads = outer.gradient(penalty, model.trainable_variables)
    assert all(g is not None and bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads[:2])


def test_keras_still_calls_the_backend_convolutions_by_module_attribute():
    """The contract: keras.ops.conv / conv_transpose look conv / conv_transpose up on backend.nn
    at each call, taking (inputs, kernel, ...) first."""
    backend = backend_ops.backend_nn()
    x, kernel = tf.ones((1, 4, 4, 1)), tf.ones((2, 2, 1, 1))
    kernels = {"separable_conv": (kernel, tf.ones((1, 1, 1, 1)))}
    for name in conv.FUNCTIONS:
        tensors = backend_ops.FUNCTION_SIGNATURES[name]
        assert list(inspect.signature(getattr(backend, name)).parameters)[:len(tensors)] == list(tensors)
        seen = []
        real = getattr(backend, name)
        try:
            setattr(backend, name, lambda *args, real=real, **kwargs: seen.append(name) or real(*args, **kwargs))
            getattr(keras.ops, name)(x, *kernels.get(name, (kernel,)))
        finally:
            setattr(backend, name, real)
        assert seen == [name]
        assert any("backend.nn" in row and f"{name}(" in row for row, _ in contracts.CALL_ORDER)


def _channels_first_model():
    inputs = keras.Input((3, 8, 8))
    x = keras.layers.Conv2D(4, 3, data_format="channels_first")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(x)))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _plain_keras_trains(model, x):
    """Whether `model.fit` runs on `x`, or TensorFlow's CPU kernel refuses its channels_first conv."""
    try:
        model.fit(x, Y, batch_size=2, verbose=0)
    except tf.errors.InvalidArgumentError as error:
        assert "NHWC" in str(error)  # Eigen's Conv2D / Conv2DCustomBackpropFilterOp
        return False
    return True


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_tensorflows_cpu_kernels_train_channels_first_convolutions_where_the_premise_says(policy):
    """The premise the next test rests on, against the real kernels: only oneDNN trains a
    channels_first Conv2D, and float16 only where its oneDNN takes float16."""
    keras.config.set_dtype_policy(policy)  # restored by the conftest fixture
    model = _channels_first_model()
    compute = model.layers[1].compute_dtype
    assert _plain_keras_trains(model, np.transpose(X, (0, 3, 1, 2))) is channels_first_conv_trains(compute)


def test_a_channels_first_float16_conv_trains_in_float32_inside_where_tensorflows_cpu_kernel_refuses():
    """Where TensorFlow's CPU kernels refuse float16 channels_first gradients but train
    float32 ones (oneDNN on, without float16: Zen 4, Cascade Lake), a float16 model trains
    in float32 inside. Skipped where the premise does not hold, naming it."""
    require(channels_first_conv_trains("float32"), "TensorFlow trains channels_first Conv2D in "
            "float32 only with oneDNN on; Eigen's kernels refuse it in every dtype")
    require(not channels_first_conv_trains("float16"), "plain Keras trains a float16 channels_first "
            "Conv2D here (this CPU's oneDNN takes float16, or Keras compiles it with XLA): "
            "it has nothing to refuse")
    x = np.transpose(X, (0, 3, 1, 2))
    keras.config.set_dtype_policy("mixed_float16")  # restored by the conftest fixture
    plain = _channels_first_model()
    keras.config.set_dtype_policy("float32")
    assert not _plain_keras_trains(plain, x)
    with injected_facts(ZEN4), warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        with tfmp.policy_scope("mixed_float16"):
            model = _channels_first_model()
    history = model.fit(x, Y, batch_size=2, epochs=2, verbose=0)
    assert all(math.isfinite(loss) for loss in history.history["loss"])
