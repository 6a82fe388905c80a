"""One switch for the speed features (`tfmp.enable(speedups=...)`), per feature and per model.

Each feature's effect is read from the traced train step (op types), never timed.
The machine is injected (`_machines`): a CPU where every feature applies, and a GPU
machine, where none was measured and each keeps Keras's path. The last tests
check that plain Keras and TensorFlow still do what each feature works around:
when a release fixes one, its test fails and the feature can go.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _machines import A100, SAPPHIRE_RAPIDS, ZEN4
from _collect import collect_everything
from _traced import forward_and_backward_ops, fused_matmuls, op_counts, post_optimization_ops

import tfmp
from tfmp._src.float32 import bias_gradient
from tfmp._src.attachment import hooks as attachment_hooks
from tfmp._src.keras_hooks import availability, step_scope, surfaces
from tfmp._src.policy import float16_fusion, speedups
from tfmp._src.policy.hardware import injected_facts

X = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype("float32")
Y = np.ones((4, 2), "float32")
pytestmark = pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")  # 16 bits emulated on CPUs


@pytest.fixture(autouse=True)
def always_disable():
    yield
    tfmp.disable()


def _compiled(policy, speedups_value, facts=ZEN4):
    """Conv2D + BatchNormalization + Dense(gelu) + Dense under `policy`, compiled by tfmp with Adam."""
    with injected_facts(facts), bias_gradient.injected(loses=False):
        tfmp.enable(policy, speedups=speedups_value)
        model = keras.Sequential([
            keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
            keras.layers.Flatten(), keras.layers.Dense(8, activation="gelu"), keras.layers.Dense(2)])
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def _train_step_ops(model):
    """Op types (with the first output's dtype) of the model's traced train step, the update included."""
    return op_counts(lambda x, y: model.train_step((x, y)), tf.constant(X), tf.constant(Y), dtypes=True)


def _has(ops, op_type):
    return any(key.split(":")[0] == op_type for key in ops)


def test_every_speed_feature_is_on_by_default_on_a_cpu_and_shows_in_the_step():
    model = _compiled("mixed_bfloat16", True)
    found = tfmp.attachment(model)
    assert found.speedups == dict.fromkeys(speedups.FEATURES, "on")
    assert found.gelu.startswith("float32 inside") and found.batchnorm_kernel == {"batch_normalization": "fused"}
    assert model.optimizer.fused_updates is True
    ops = _train_step_ops(model)
    assert _has(ops, "FusedBatchNormV3") and _has(ops, "ResourceApplyAdam")
    assert ops["Erfc:float32"] >= 1  # the exact GELU in float32 inside


def test_speedups_false_gives_the_step_keras_paths_and_the_attachment_says_so():
    model = _compiled("mixed_bfloat16", False)
    found = tfmp.attachment(model)
    assert found.speedups == dict.fromkeys(speedups.FEATURES, speedups.OFF_BY_SWITCH)
    assert found.gelu == found.conv == speedups.KERAS_BY_SWITCH
    assert found.batchnorm_kernel == {"batch_normalization": speedups.keras_field(speedups.OFF_BY_SWITCH)}
    assert model.optimizer.fused_updates is False
    ops = _train_step_ops(model)
    assert not _has(ops, "FusedBatchNormV3") and not _has(ops, "ResourceApplyAdam")
    assert ops["Erf:bfloat16"] + ops["Erfc:bfloat16"] >= 1 and not ops["Erfc:float32"] + ops["Erf:float32"]
    # What is not a speed feature stays: float32 outputs and the loss-scale optimizer.
    assert model.layers[-1].dtype_policy.name == "float32"
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)


def _speed_hooks():
    """The speed features with a hook now on a Keras class or module."""
    return sorted({hook.owner for hook in surfaces.process_wide()} & attachment_hooks.SPEED)


def test_speedups_false_installs_no_speed_hook_and_one_feature_on_installs_its_own():
    collect_everything()
    tfmp.disable()  # no earlier model holds the hooks
    assert _speed_hooks() == []
    plain = _compiled("mixed_bfloat16", False)
    assert _speed_hooks() == []
    plain.fit(X, Y, batch_size=2, verbose=0)
    assert _speed_hooks() == []
    _compiled("mixed_bfloat16", {"gelu": False, "conv": False, "cross_entropy": False})
    assert _speed_hooks() == ["fused_batchnorm"]
    _compiled("mixed_bfloat16", True)
    assert _speed_hooks() == ["conv", "cross_entropy", "fused_batchnorm", "gelu"]


def test_one_feature_off_leaves_the_others_on():
    model = _compiled("mixed_bfloat16", {"fused_update": False})
    assert tfmp.attachment(model).speedups["fused_update"] == speedups.OFF_BY_SWITCH
    assert {v for k, v in tfmp.attachment(model).speedups.items() if k != "fused_update"} == {"on"}
    ops = _train_step_ops(model)
    assert _has(ops, "FusedBatchNormV3") and not _has(ops, "ResourceApplyAdam")


def test_each_model_keeps_the_switch_it_was_compiled_with():
    fast = _compiled("mixed_bfloat16", True)
    plain = _compiled("mixed_bfloat16", False)  # a second enable() with other speedups
    tfmp.disable()
    assert tfmp.attachment(fast).speedups["fused_batchnorm"] == "on"
    assert tfmp.attachment(plain).speedups["fused_batchnorm"] == speedups.OFF_BY_SWITCH
    assert _has(_train_step_ops(fast), "FusedBatchNormV3")
    assert not _has(_train_step_ops(plain), "FusedBatchNormV3")


@pytest.mark.parametrize("switch", [True, {"remapper": False, "conv": False}])
def test_the_float16_remapper_and_convolution_switches_on_the_cpu_with_the_trap(switch):
    model = _compiled("mixed_float16", switch, facts=SAPPHIRE_RAPIDS)
    found = tfmp.attachment(model)
    if switch is True:
        assert found.remapper.startswith("off: ") and found.conv.startswith("float32 inside")
        assert found.depthwise_conv.startswith("float32 inside")  # oneDNN takes float16 there
        assert step_scope.scope_of(model) == "remapper off"
    else:
        assert found.remapper == "on" and found.conv == found.depthwise_conv == speedups.KERAS_BY_SWITCH
        assert step_scope.scope_of(model) is None
        assert found.speedups["fused_batchnorm"] == "on"


def test_on_a_gpu_machine_no_speed_feature_runs_and_the_step_is_kerass():
    """None was measured on a GPU: each keeps Keras's path there (A100 facts injected)."""
    with injected_facts(A100):
        model = _compiled("mixed_bfloat16", True, facts=A100)
        assert model.optimizer.fused_updates is False
        ops = _train_step_ops(model)
    found = tfmp.attachment(model)
    assert found.speedups == dict.fromkeys(speedups.FEATURES, speedups.OFF_ON_ACCELERATOR)
    assert found.gelu == found.conv == "keras" and found.remapper == "on"  # their own GPU rule
    assert found.batchnorm_kernel == {"batch_normalization": speedups.keras_field(speedups.OFF_ON_ACCELERATOR)}
    assert not _has(ops, "FusedBatchNormV3") and not _has(ops, "ResourceApplyAdam")


def test_a_loss_scale_optimizer_made_by_hand_takes_fused_updates_only_where_measured_and_wanted():
    with injected_facts(ZEN4):
        assert tfmp.LossScaleOptimizer(keras.optimizers.SGD()).fused_updates is True
        with tfmp.policy_scope("mixed_bfloat16", speedups={"fused_update": False}):
            assert tfmp.LossScaleOptimizer(keras.optimizers.SGD()).fused_updates is False
    with injected_facts(A100):
        assert tfmp.LossScaleOptimizer(keras.optimizers.SGD()).fused_updates is False


def test_a_model_loaded_under_the_switch_off_takes_kerass_update(tmp_path):
    model = _compiled("mixed_bfloat16", True)
    model.fit(X, Y, verbose=0)
    model.save(tmp_path / "model.keras")
    tfmp.disable()
    with injected_facts(ZEN4), bias_gradient.injected(loses=False):
        tfmp.enable("mixed_bfloat16", speedups=False)
        loaded = keras.models.load_model(tmp_path / "model.keras")
    assert tfmp.attachment(loaded).speedups["fused_update"] == speedups.OFF_BY_SWITCH
    assert loaded.optimizer.fused_updates is False
    ops = _train_step_ops(loaded)
    assert not _has(ops, "ResourceApplyAdam") and not _has(ops, "FusedBatchNormV3")


def test_a_feature_whose_keras_surface_moved_reads_off_with_why():
    assert availability.off("gelu") is None
    try:
        with pytest.warns(UserWarning, match="tfmp turned one feature off") as said:
            availability.switch_off("gelu", AttributeError("module 'keras.src.backend' has no attribute 'nn'"))
        with injected_facts(ZEN4):
            found = speedups.decided(None)
    finally:
        availability.clear()
    assert found["gelu"].startswith("off (Keras ") and "has no attribute 'nn'" in found["gelu"]
    # the error's text, of any length, below the guide line; the opening's lines stay short with any version
    text = str(said[0].message).splitlines()
    assert text[-1] == "What failed: AttributeError: module 'keras.src.backend' has no attribute 'nn'"
    assert text[-2].startswith("Guide: ") and "has no attribute" not in "\n".join(text[:-1])
    assert found["conv"] == "on"


def test_policy_scope_takes_the_switch_too():
    with injected_facts(ZEN4), tfmp.policy_scope("mixed_bfloat16", speedups=False):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    assert tfmp.attachment(model).speedups["fused_update"] == speedups.OFF_BY_SWITCH
    assert model.optimizer.fused_updates is False


# -- what each feature works around, still so in plain Keras and TensorFlow ----------


def _plain(policy, *layers, input_shape=(8, 8, 3)):
    """A plain Keras model under `policy` of the layers `layers` (classes or factories) make."""
    keras.config.set_dtype_policy(policy)  # restored by the conftest fixture
    model = keras.Sequential([keras.Input(input_shape), *(make() for make in layers)])
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def test_keras_still_normalizes_a_mixed_batch_without_the_fused_kernel():
    """fused_batchnorm: Keras's BatchNormalization computes moments and the normalization op by op."""
    model = _plain("mixed_bfloat16", keras.layers.BatchNormalization, keras.layers.Flatten,
                   lambda: keras.layers.Dense(2))
    ops = forward_and_backward_ops(model, tf.constant(X), tf.constant(Y))
    assert not _has(ops, "FusedBatchNormV3") and not _has(ops, "FusedBatchNormGradV3")


def test_keras_still_computes_the_exact_bfloat16_gelu_in_bfloat16():
    """gelu: Keras's exact GELU runs its error function in bfloat16 (TensorFlow converts inside each op on a CPU)."""
    model = _plain("mixed_bfloat16", lambda: keras.layers.Dense(8, activation="gelu"),
                   lambda: keras.layers.Dense(2), input_shape=(4,))
    ops = forward_and_backward_ops(model, tf.ones((4, 4)), tf.ones((4, 2)))
    assert ops["Erf:bfloat16"] + ops["Erfc:bfloat16"] >= 1
    assert not ops["Erf:float32"] + ops["Erfc:float32"]


def test_keras_still_convolves_float16_in_float16():
    """conv: a mixed_float16 Conv2D hands TensorFlow a float16 Conv2D (Eigen's slow kernel on CPUs)."""
    model = _plain("mixed_float16", lambda: keras.layers.Conv2D(4, 3), keras.layers.Flatten,
                   lambda: keras.layers.Dense(2))
    ops = forward_and_backward_ops(model, tf.constant(X), tf.constant(Y))
    assert ops["Conv2D:float16"] >= 1 and ops["Conv2DBackpropFilter:float16"] >= 1


def test_keras_still_updates_adam_and_sgd_with_a_chain_of_ops():
    """fused_update: Keras's Adam and SGD update each variable op by op, never with a training kernel."""
    kernels = {"ResourceApplyAdam", "ResourceApplyKerasMomentum", "ResourceApplyGradientDescent"}
    for optimizer in (keras.optimizers.Adam(), keras.optimizers.SGD(momentum=0.9), keras.optimizers.SGD()):
        variable = keras.Variable(np.ones((4, 4), "float32"))
        optimizer.build([variable])
        ops = op_counts(lambda g: optimizer.apply([g], [variable]), tf.ones((4, 4)))
        assert not kernels & set(ops), (optimizer, ops)


def test_tensorflow_still_fuses_a_matmul_with_its_bias_add_in_the_remapper():
    """remapper: Grappler's remapper still fuses MatMul + BiasAdd + ReLU; on a CPU whose oneDNN
    takes float16 (this machine's facts, not injected) the float16 one, the kernel that crawls."""
    dtype = tf.float16 if float16_fusion.remapper_trap("float16") else tf.float32

    @tf.function
    def dense(x, kernel, bias):
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(x, kernel), bias))

    with post_optimization_ops() as ops:
        dense(tf.ones((4, 8), dtype), tf.ones((8, 8), dtype), tf.zeros((8,), dtype))
    assert fused_matmuls(ops)
