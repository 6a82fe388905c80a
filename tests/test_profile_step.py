"""The step profiler classifies ops as written down here, and its shares add up; no timing asserts."""

import pathlib
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness, op_classes, profile_step, run  # noqa: E402
from benchmarks.op_classes import OpEvent  # noqa: E402

# Op names and types as TensorFlow 2.21's profiler records them in a Keras 3.15
# train step (oneDNN on), with the category each belongs to.
KNOWN_OPS = [
    ("StatefulPartitionedCall/functional_1/dense_1/Relu", "_MklNativeFusedMatMul", "matmul"),
    ("StatefulPartitionedCall/gradient_tape/functional_1/dense_1_2/MatMul/MatMul_1", "_MklMatMul", "matmul"),
    ("StatefulPartitionedCall/transformer/multi_head_attention/einsum/Einsum", "_MklEinsum", "matmul"),
    ("StatefulPartitionedCall/gradient_tape/vit/mha/MatMul", "_MklBatchMatMulV2", "matmul"),
    ("StatefulPartitionedCall/gradient_tape/cnn/conv2d/Conv2DBackpropFilter",
     "_MklNativeConv2DBackpropFilter", "matmul"),
    ("StatefulPartitionedCall/adam/Sqrt_3", "Sqrt", "optimizer"),
    ("StatefulPartitionedCall/adam/Cast_14", "Cast", "optimizer"),
    ("StatefulPartitionedCall/adam/AssignSubVariableOp_2", "AssignSubVariableOp", "optimizer"),
    ("StatefulPartitionedCall/loss_scale_optimizer/IsFinite", "IsFinite", "optimizer"),
    ("StatefulPartitionedCall/SGD/ResourceApplyGradientDescent", "ResourceApplyGradientDescent", "optimizer"),
    ("StatefulPartitionedCall/functional_1/dense_1/Cast/Cast", "Cast", "cast"),
    ("StatefulPartitionedCall/functional_1/layer_normalization_1/Cast_1", "Cast", "cast"),
    ("StatefulPartitionedCall/functional_1/layer_normalization_1/moments/variance", "Mean", "normalization"),
    ("StatefulPartitionedCall/gradient_tape/functional_1/layer_normalization_1/RsqrtGrad", "RsqrtGrad",
     "normalization"),
    ("StatefulPartitionedCall/resnet50/conv2_block1_1_bn/FusedBatchNormV3", "_MklNativeFusedBatchNormV3",
     "normalization"),
    ("StatefulPartitionedCall/resnet50/conv2_block1_1_bn/moments/mean", "Mean", "normalization"),
    ("StatefulPartitionedCall/decoder/transformer_block/layernorm1/add", "AddV2", "normalization"),
    ("StatefulPartitionedCall/transformer/multi_head_attention/softmax/Softmax", "_MklSoftmax", "softmax"),
    ("StatefulPartitionedCall/gradient_tape/transformer/multi_head_attention/softmax/mul", "Mul", "softmax"),
    ("StatefulPartitionedCall/compile_loss/sparse_categorical_crossentropy/SparseSoftmaxCrossEntropyWithLogits/"
     "SparseSoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits", "softmax"),
    ("StatefulPartitionedCall/functional_1/dense_1/BiasAdd/Cast/ReadVariableOp", "ReadVariableOp", "other"),
    ("StatefulPartitionedCall/AssignVariableOp_1", "AssignVariableOp", "other"),
    ("StatefulPartitionedCall/strided_slice", "StridedSlice", "other"),
    ("StatefulPartitionedCall/gradient_tape/functional_1/dense_1/ReluGrad", "ReluGrad", "elementwise"),
    ("StatefulPartitionedCall/transformer/multi_head_attention/transpose", "_MklTranspose", "elementwise"),
    ("StatefulPartitionedCall/cnn/max_pooling2d/MaxPool2d", "_MklNativeMaxPool", "elementwise"),
]


@pytest.mark.parametrize("name, op_type, category", KNOWN_OPS)
def test_known_ops_fall_in_their_category(name, op_type, category):
    assert op_classes.classify(name, op_type) == category


def test_an_optimizer_named_otherwise_is_found_by_its_scope():
    name = "StatefulPartitionedCall/my_optimizer/Sqrt"
    assert op_classes.classify(name, "Sqrt") == "elementwise"
    assert op_classes.classify(name, "Sqrt", {"my_optimizer"}) == "optimizer"


def test_dtype_widths():
    assert [op_classes.width(d) for d in ("bfloat16", "float16", "float32", "int32", "bool", None)] == [
        "16-bit", "16-bit", "32-bit", "other", "other", "other"]


def test_grappler_renamed_ops_find_their_dtype():
    dtypes = {"a/layer_normalization/add_2": "bfloat16"}
    assert op_classes.lookup_dtype("a/layer_normalization/ArithmeticOptimizer/AddOpsRewrite_add_2", dtypes) \
        == "bfloat16"
    assert op_classes.lookup_dtype("a/unknown", dtypes) is None


def test_breakdown_of_a_hand_made_trace():
    # Window 0-100 ps, 2 steps. Thread 0: a matmul 0-40 holding a nested cast 5-15,
    # then a Softmax 50-60. Thread 1: a Mul 10-30 (elementwise) and an Adam Sqrt 90-110
    # (only 90-100 inside the window).
    ops = [
        OpEvent(0, 40, "f/dense/MatMul", "MatMul", 0),
        OpEvent(5, 15, "f/dense/Cast", "Cast", 0),
        OpEvent(50, 60, "f/mha/softmax/Softmax", "Softmax", 0),
        OpEvent(10, 30, "f/mul", "Mul", 1),
        OpEvent(90, 110, "f/adam/Sqrt", "Sqrt", 1),
    ]
    dtypes = {"f/dense/MatMul": "bfloat16", "f/dense/Cast": "bfloat16", "f/mha/softmax/Softmax": "float32",
              "f/mul": "bfloat16"}
    b = op_classes.breakdown(ops, (0, 100), 2, dtypes)
    # Exclusive op time: matmul 30, cast 10, softmax 10, mul 20, sqrt 10 = 80 ps.
    # Busy (some op running): 0-40, 50-60, 90-100 = 60 of 100 ps.
    assert b["busy_fraction"] == pytest.approx(0.6)
    expected = {"matmul": 30 / 80 * 0.6, "normalization": 0.0, "softmax": 10 / 80 * 0.6,
                "cast": 10 / 80 * 0.6, "elementwise": 20 / 80 * 0.6, "optimizer": 10 / 80 * 0.6,
                "other": 0.0, "host": 0.4}
    assert b["shares"] == pytest.approx(expected)
    assert sum(b["shares"].values()) == pytest.approx(1.0)
    # 16-bit: matmul, cast, mul = 60 of 80; 32-bit: softmax 10; other: sqrt (no dtype) 10.
    assert b["width_of_ops"] == pytest.approx({"16-bit": 0.75, "32-bit": 0.125, "other": 0.125})
    assert b["step_ms"] == pytest.approx(50 / 1e9)
    assert b["top_ops"][0] == {"type": "MatMul", "category": "matmul", "share_of_op_time": 30 / 80}


def test_profile_of_a_tiny_model_adds_up(tmp_path):
    workload = run.workloads(quick=True)["mlp"]
    # tfmp enables mixed_bfloat16 whatever "auto" picks on this CPU (float32 without bfloat16).
    prepared = harness.prepare(workload, "tfmp", "mixed_bfloat16", str(tmp_path), 2,
                               harness.Overrides(tfmp_policy="mixed_bfloat16"))
    b = profile_step.profile_run(prepared, 2, tempfile.mkdtemp(dir=tmp_path))
    assert set(b["shares"]) == set(op_classes.CATEGORIES)
    assert sum(b["shares"].values()) == pytest.approx(1.0, abs=1e-6)
    assert all(share >= 0 for share in b["shares"].values())
    assert b["shares"]["matmul"] > 0 and b["shares"]["optimizer"] > 0
    assert not b["unknown_dtype_functions"]
    # Under mixed_bfloat16 the Dense layers' matmuls run in bfloat16.
    assert b["width_by_category"]["matmul"]["16-bit"] > 0.5
    assert sum(b["width_of_ops"].values()) == pytest.approx(1.0)
    text = profile_step.markdown({"models": {"mlp": {"configs": {"tfmp": b}}}})
    assert "| mlp | tfmp |" in text and np.isfinite(b["step_ms"])


def test_an_xla_compiled_function_is_one_op_named_after_its_call(tmp_path):
    """XLA's fused loops are no ops of the trace: its run counts, in the scope of the op that called it."""
    fused = tf.function(lambda x: tf.exp(-x * x) * 3.0 + x, jit_compile=True)

    @tf.function
    def step(x):
        with tf.name_scope("dense_gelu"):
            return tf.reduce_sum(fused(x))

    x = tf.random.stateless_normal((2048, 1024), seed=(0, 1))
    step(x)  # traced and compiled before the profile
    tf.profiler.experimental.start(str(tmp_path))
    try:
        step(x).numpy()
    finally:
        tf.profiler.experimental.stop()
    path = sorted(tmp_path.glob("**/*.xplane.pb"))[-1]
    ops, _, _ = op_classes.read_trace(str(path))
    runs = [op for op in ops if op.op_type == op_classes.XLA_TYPE]
    assert len(runs) == 1
    assert runs[0].name.startswith("dense_gelu/") and runs[0].end > runs[0].start
    assert op_classes.classify(runs[0].name, runs[0].op_type) == "elementwise"
