"""What a traced function holds: op types counted, for op-for-op comparisons with plain Keras;
and the op types TensorFlow ran after Grappler optimized them."""

import collections
import contextlib

import tensorflow as tf
from tensorflow.python.eager import context


def op_counts(function, *args, dtypes=False):
    """Op types (with counts) of ``function`` traced on ``args``, nested function bodies
    (cond branches, custom gradients) included; with ``dtypes``, keyed ``"type:dtype of
    first output"``."""
    concrete = tf.function(function).get_concrete_function(*args)
    graphs = [concrete.graph] + [f.graph for f in concrete.graph._functions.values()]
    return collections.Counter(
        op.type + (f":{op.outputs[0].dtype.name}" if dtypes and op.outputs else "")
        for graph in graphs for op in graph.get_operations())


def forward_and_backward_ops(model, x, y):
    """`op_counts` (with dtypes) of a model's forward pass, loss and gradients on ``(x, y)``."""
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x, y, model(x, training=True), training=True)
        return tape.gradient(loss, model.trainable_variables)

    return op_counts(step, x, y, dtypes=True)


@contextlib.contextmanager
def post_optimization_ops():
    """Collects the op types of every function TensorFlow instantiates in the block
    (from its RunMetadata: the graphs after Grappler)."""
    ops = []
    eager = context.context()
    eager.enable_run_metadata()
    # TensorFlow goes on recording function graphs after an earlier block's
    # disable_run_metadata(); the next export would return them too. Drop them.
    eager.export_run_metadata()
    try:
        yield ops
    finally:
        metadata = eager.export_run_metadata()
        eager.disable_run_metadata()
        ops.extend(node.op for graph in metadata.function_graphs
                   for node in graph.post_optimization_graph.node)


def fused_matmuls(ops):
    """The fused matmul op types among `ops` (_FusedMatMul, _MklFusedMatMul, _MklNativeFusedMatMul)."""
    return {op for op in ops if "FusedMatMul" in op}
