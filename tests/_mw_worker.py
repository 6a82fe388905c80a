"""One worker of a two-process MultiWorkerMirroredStrategy cluster; run by
test_distribute.py with `TF_CONFIG` naming both workers on 127.0.0.1.

    TF_CONFIG=... python tests/_mw_worker.py --out result.json --log-dir DIR

Each worker builds the same tiny model under `tfmp.enable("mixed_float16")`,
compiles it (so tfmp wraps the optimizer) and trains it for four steps with a custom
loop (`strategy.run` + `tfmp.scaled_gradients`): Keras 3.15's `model.fit` itself
fails under this strategy (keras-team/keras issue 20585). Every worker reads its own
input pipeline; worker 1's batch 1 holds an inf, so that step overflows on one worker
only. Both drive a `tfmp.LossScaleMonitor` on the same folder, as `fit` would. The
JSON result holds the task, its pid, whether it counts as chief, the final weights,
the optimizer's scale and counters and the scale after each step.
"""

import argparse
import json
import os
import pathlib
import sys
import warnings

import tensorflow as tf

# Must come first: the strategy starts this task's server from TF_CONFIG.
STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
from _dist_train import LEARNING_RATE  # noqa: E402
from _dist_train import LSO_OPTIONS  # noqa: E402
from _dist_train import STATE  # noqa: E402
from _dist_train import arrays  # noqa: E402
from _dist_train import build_model  # noqa: E402
from _dist_train import custom_step  # noqa: E402

import tfmp  # noqa: E402
from tfmp._src.distribute import is_chief  # noqa: E402

PER_WORKER_BATCH, STEPS = 4, 4
BAD_WORKER, BAD_STEP = 1, 1


def worker_dataset(context):
    """This worker's own batches (one input pipeline per worker)."""
    worker = context.input_pipeline_id
    bad_row = BAD_STEP * PER_WORKER_BATCH if worker == BAD_WORKER else None
    x, y = arrays(STEPS * PER_WORKER_BATCH, bad_row, offset=0.25 * worker)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(PER_WORKER_BATCH)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # float16 on a CPU
    with tfmp.policy_scope("mixed_float16", loss_scale_options=LSO_OPTIONS):
        with STRATEGY.scope():
            model = build_model()
            model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
            optimizer = model.optimizer
            optimizer.build(model.trainable_variables)
    global_batch = PER_WORKER_BATCH * STRATEGY.num_replicas_in_sync
    step = custom_step(STRATEGY, model, optimizer, global_batch)
    batches = STRATEGY.distribute_datasets_from_function(worker_dataset)
    callbacks = keras.callbacks.CallbackList(
        [tfmp.LossScaleMonitor(args.log_dir, update_freq="batch")], model=model
    )
    scales = []
    callbacks.on_train_begin()
    callbacks.on_epoch_begin(0)
    for index, (x, y) in enumerate(batches):
        step(x, y)
        optimizer.raise_if_stuck()
        callbacks.on_train_batch_end(index)
        scales.append(optimizer.loss_scale)
    callbacks.on_epoch_end(0)
    callbacks.on_train_end()
    result = {
        "pid": os.getpid(),
        "is_chief": is_chief(STRATEGY),
        "replicas": STRATEGY.num_replicas_in_sync,
        "optimizer": type(optimizer).__name__,
        "scales": scales,
        "state": {name: getattr(optimizer, name).numpy().item() for name in STATE},
        "iterations": int(optimizer.iterations.numpy()),
        "weights": [w.tolist() for w in model.get_weights()],
    }
    pathlib.Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
