"""Tiny model, data, custom train step and state readers for the distributed scripts.

Imported by tests/_dist_case.py (MirroredStrategy) and tests/_mw_worker.py
(MultiWorkerMirroredStrategy); it configures no device and creates no strategy, so
each script can do that first.
"""

import keras
import numpy as np
import tensorflow as tf

import tfmp
from tfmp._src.loss_scale.optimizer import STATE_VARIABLES

#: Options of every tfmp.LossScaleOptimizer in the scripts: with growth every 2 finite
#: steps, a run finite-overflow-finite-finite gives scales 1024, 512, 512, 1024.
LSO_OPTIONS = {"initial_scale": 2.0**10, "dynamic_growth_steps": 2}
LEARNING_RATE = 0.01
STATE = STATE_VARIABLES


def build_model():
    """Dense(4, relu) -> Dense(1), every weight 0.125: same start on every replica."""
    init = keras.initializers.Constant(0.125)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, activation="relu", kernel_initializer=init),
            keras.layers.Dense(1, kernel_initializer=init),
        ]
    )


def arrays(rows, bad_row=None, offset=0.0):
    """x: (rows, 4) float32 ramp in [-1, 1] + offset, inf at x[bad_row, 0]; y: ones."""
    x = np.linspace(-1.0, 1.0, rows * 4, dtype="float32").reshape(rows, 4) + offset
    if bad_row is not None:
        x[bad_row, 0] = np.inf
    return x, np.ones((rows, 1), "float32")


def custom_step(strategy, model, optimizer, global_batch):
    """A `tf.function` train step for `strategy.run`: tfmp.scaled_gradients + apply.

    The loss is the mean squared error averaged over the global batch
    (`tf.nn.compute_average_loss`), as TensorFlow's custom-loop guide does.
    """

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            pred = tf.cast(model(x, training=True), tf.float32)
            loss = tf.nn.compute_average_loss(
                tf.reduce_mean(tf.square(pred - y), axis=-1),
                global_batch_size=global_batch,
            )
        variables = model.trainable_variables
        grads = tfmp.scaled_gradients(tape, loss, variables, optimizer)
        optimizer.apply(grads, variables)

    @tf.function
    def step(x, y):
        strategy.run(replica_step, args=(x, y))

    return step


def local(strategy, variable):
    """This process's per-replica copies of a keras.Variable, as Python values."""
    copies = strategy.experimental_local_results(variable.value)
    return [np.asarray(copy.numpy()).tolist() for copy in copies]


def state(strategy, optimizer):
    """{name: [value on each local replica]} of the tfmp optimizer variables."""
    return {name: local(strategy, getattr(optimizer, name)) for name in STATE}


def weights(strategy, model):
    """[[value on each local replica] for each model weight]."""
    return [local(strategy, w) for w in model.weights]
