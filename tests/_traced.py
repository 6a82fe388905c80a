"""What a traced function holds: op types counted, for op-for-op comparisons with plain Keras."""

import collections

import tensorflow as tf


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
