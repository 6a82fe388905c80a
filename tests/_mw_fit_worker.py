"""One worker of a MultiWorkerMirroredStrategy cluster training with `model.fit`;
run by tests/test_multi_worker_fit.py with `TF_CONFIG` naming every worker on 127.0.0.1.

    TF_CONFIG=... python tests/_mw_fit_worker.py --out result.json --policy auto \
        --order after --log-dir DIR [--plain] [--timeout S] [--machine zen4]
        [--backup DIR --progress FILE [--die-at EPOCH]]

Every worker builds the same tiny Dense model (weights 0.125) and trains it with
`model.fit` on the same global batches of `PER_WORKER` (4) rows per worker (a
`tf.data` dataset, sharded by data): worker N's share of each global batch is its
rows N*4 .. N*4+3. Row 1 of the last worker's share of the last batch of each epoch is
inf, so that step overflows on one worker only (`BAD_STEP`). `--order` says
whether `tfmp.enable()` (with `loss_scale_options`) comes before the strategy is
created or after. The strategy comes from `tfmp.multi_worker_strategy` (`--timeout`:
seconds to wait for the other workers; past it the process is killed after a
message naming the missing worker). The chief also trains the same model in one
process, without a strategy, on the same global batches (`reference`).

Cases (one process runs them in this order; the result holds each one's findings):

* ``plain`` (with ``--plain``, before tfmp is enabled): plain Keras's `fit` of the
  same model under the strategy, and the error it raises.
* ``fit``: `fit` (2 epochs, a `tfmp.LossScaleMonitor` on `--log-dir`, the loss after
  each batch, the scale after each step), then `evaluate` and `predict` on clean
  rows; the optimizer's state and the weights; the chief saves the model
  (`--out`.keras), which ``reference`` opens without a strategy.
* ``dict``: a model with two named inputs, fitted on a dict dataset.
* ``refused``: compiling with ``steps_per_execution=2`` under the strategy, and `fit`
  after setting it to 2 on a model compiled with 1.
* ``backup`` (with ``--backup``, instead of the others): 3 epochs with
  `keras.callbacks.BackupAndRestore` in this worker's own folder, saving each
  epoch (``double_checkpoint=True``, as docs/guides/distributed.md shows it); with ``--die-at E`` the process ends itself (exit code `DIED`) at batch 1 of
  epoch E, as a killed worker would. Each epoch's start and end are appended to
  ``--progress`` (JSON lines: epoch, iterations, scale, counters).
"""

import argparse
import contextlib
import json
import os
import pathlib
import sys
import traceback
import warnings

ORDER = "after"
if "--order" in sys.argv:
    ORDER = sys.argv[sys.argv.index("--order") + 1]
POLICY = sys.argv[sys.argv.index("--policy") + 1] if "--policy" in sys.argv else "auto"

TIMEOUT_S = float(sys.argv[sys.argv.index("--timeout") + 1]) if "--timeout" in sys.argv else 120.0

import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402

if "--machine" in sys.argv:  # a machine of tests/_machines.py made this process's, for its lifetime
    from _machines import ALL  # noqa: E402

    from tfmp._src.policy.hardware import injected_facts  # noqa: E402

    MACHINE = injected_facts(ALL[sys.argv[sys.argv.index("--machine") + 1]])  # kept: collected, it ends
    MACHINE.__enter__()

LSO_OPTIONS = {"initial_scale": 2.0**10, "dynamic_growth_steps": 2}
if ORDER == "before":
    # Before the strategy: nothing here may start TensorFlow's runtime.
    tfmp.enable(POLICY, loss_scale_options=LSO_OPTIONS)

STRATEGY = tfmp.multi_worker_strategy(timeout_s=TIMEOUT_S)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfmp._src.distribute import is_chief  # noqa: E402
from tfmp._src.loss_scale.optimizer import STATE_VARIABLES  # noqa: E402

PER_WORKER = 4
STEPS, EPOCHS = 4, 2
BAD_STEP = STEPS - 1  # the last batch: every running loss before it is finite
LEARNING_RATE = 0.05
DIED = 17


def workers():
    return STRATEGY.num_replicas_in_sync


def arrays(bad=True):
    """x: (STEPS * global batch, 4) ramp in [-1, 1]; y: a linear target; one inf."""
    rows = STEPS * PER_WORKER * workers()
    x = np.linspace(-1.0, 1.0, rows * 4, dtype="float32").reshape(rows, 4)
    y = (x @ np.array([[0.5], [-0.25], [0.75], [0.125]], "float32") + 0.5).astype("float32")
    if bad:
        x[BAD_STEP * PER_WORKER * workers() + (workers() - 1) * PER_WORKER + 1, 0] = np.inf
    return x, y


def dataset(x, y):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    batch = PER_WORKER * workers()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).with_options(options)


def build_model():
    init = keras.initializers.Constant(0.125)
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu", kernel_initializer=init),
        keras.layers.Dense(1, kernel_initializer=init),
    ])


def compiled(strategy=None, **compile_args):
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = build_model()
        model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", **compile_args)
    return model


class Record(keras.callbacks.Callback):
    """The running loss after each batch and the scale after each step."""

    def __init__(self):
        super().__init__()
        self.losses, self.scales = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))
        self.scales.append(float(self.model.optimizer.loss_scale))


def state(model):
    optimizer = model.optimizer
    found = {name: float(getattr(optimizer, name).numpy()) for name in STATE_VARIABLES}
    found["iterations"] = int(optimizer.iterations.numpy())
    found["scale"] = float(optimizer.loss_scale)
    return found


def finite_shards(data):
    """Per global batch: whether this worker's share of it is all finite."""
    return [bool(all(np.isfinite(part.numpy()).all() for part in STRATEGY.experimental_local_results(x)))
            for x, _ in STRATEGY.experimental_distribute_dataset(data)]


def train(model, callbacks=(), saved=None):
    x, y = arrays()
    record = Record()
    shards = finite_shards(dataset(x, y))
    model.fit(dataset(x, y), epochs=EPOCHS, verbose=0, callbacks=[record, *callbacks])
    clean_x, clean_y = arrays(bad=False)
    evaluated = model.evaluate(dataset(clean_x, clean_y), verbose=0)
    predicted = model.predict(dataset(clean_x, clean_y).map(lambda a, b: a), verbose=0)
    if saved and is_chief(STRATEGY):
        model.save(saved)  # opened without a strategy by `reference`
    return {
        "finite_shards": shards,
        "losses": record.losses,
        "scales": record.scales,
        "state": state(model),
        "evaluate": float(evaluated),
        "predict": predicted[:, 0].tolist(),
        "weights": [w.tolist() for w in model.get_weights()],
        "optimizer": type(model.optimizer).__name__,
    }


def plain_keras():
    """Plain Keras (tfmp not enabled in this thread) under the strategy: the error it raises."""
    model = compiled(STRATEGY)
    x, y = arrays(bad=False)
    try:
        model.fit(dataset(x, y), epochs=1, verbose=0)
    except Exception as error:  # noqa: BLE001 (recorded for the test)
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


def dict_case():
    with STRATEGY.scope():
        a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
        out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
        model = keras.Model({"a": a, "b": b}, out)
        model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    x, y = arrays(bad=False)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices(({"a": x, "b": -x}, y)).batch(PER_WORKER * workers())
    history = model.fit(data.with_options(options), epochs=1, verbose=0).history
    return {"loss": history["loss"], "weights": [w.tolist() for w in model.get_weights()]}


def refused_case():
    found = {"compile": None, "fit": None}
    try:
        compiled(STRATEGY, steps_per_execution=2)
    except ValueError as error:
        found["compile"] = str(error)
    model = compiled(STRATEGY)
    model.steps_per_execution = 2  # set after compile: refused when fit starts
    x, y = arrays(bad=False)
    try:
        model.fit(dataset(x, y), epochs=1, verbose=0)
    except ValueError as error:
        found["fit"] = str(error)
    return found


class Progress(keras.callbacks.Callback):
    """Appends each epoch's start and end state to a JSON-lines file; dies on request."""

    def __init__(self, path, die_at):
        super().__init__()
        self.path, self.die_at, self.epoch = path, die_at, None

    def _write(self, event, epoch):
        with open(self.path, "a") as file:
            file.write(json.dumps({"event": event, "epoch": epoch, **state(self.model)}) + "\n")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self._write("begin", epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._write("end", epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == self.die_at and batch == 1:
            os._exit(DIED)  # as a killed worker: no clean-up, no result


def backup_case(args):
    model = compiled(STRATEGY)
    model.build((None, 4))
    x, y = arrays()
    callbacks = [
        keras.callbacks.BackupAndRestore(args.backup, save_freq="epoch", double_checkpoint=True),
        Progress(args.progress, args.die_at),
    ]
    model.fit(dataset(x, y), epochs=3, verbose=0, callbacks=callbacks)
    return {"state": state(model), "weights": [w.tolist() for w in model.get_weights()]}


def reference(epochs, saved=None):
    """The same training in one process, without a strategy, on the same global batches;
    with `saved`, that file (saved under the strategy) opened without one."""
    opened = {}
    if saved and os.path.exists(saved):
        loaded = keras.models.load_model(saved)
        opened = {"optimizer": type(loaded.optimizer).__name__, "state": state(loaded),
                  "weights": [w.tolist() for w in loaded.get_weights()]}
    model = compiled()
    x, y = arrays()
    record = Record()
    model.fit(dataset(x, y), epochs=epochs, verbose=0, callbacks=[record])
    clean_x, clean_y = arrays(bad=False)
    return {
        "opened": opened,
        "losses": record.losses,
        "scales": record.scales,
        "state": state(model),
        "evaluate": float(model.evaluate(dataset(clean_x, clean_y), verbose=0)),
        "predict": model.predict(clean_x, verbose=0)[:, 0].tolist(),
        "weights": [w.tolist() for w in model.get_weights()],
    }


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--order", choices=("before", "after"), default="after")
    parser.add_argument("--log-dir")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--backup")
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--progress")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--machine", help="a name of tests/_machines.py ALL whose facts the process takes")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # float16 on a CPU
    result = {"pid": os.getpid(), "is_chief": is_chief(STRATEGY), "replicas": workers()}

    def run(name, case):
        try:
            result[name] = case()
        except Exception:  # noqa: BLE001 (only this case's test fails)
            result[name] = {"error": traceback.format_exc()}

    if args.plain and ORDER == "after":  # before tfmp is enabled in this thread
        run("plain", plain_keras)
    if ORDER == "after":
        tfmp.enable(args.policy, loss_scale_options=LSO_OPTIONS)
    result["policy"] = keras.config.dtype_policy().name
    if args.backup:
        run("backup", lambda: backup_case(args))
        epochs = 3
    else:
        monitor = tfmp.LossScaleMonitor(args.log_dir, update_freq="batch")
        saved = args.out + ".keras"
        run("fit", lambda: train(compiled(STRATEGY), [monitor], saved))
        run("dict", dict_case)
        run("refused", refused_case)
        epochs = EPOCHS
    if result["is_chief"]:
        run("reference", lambda: reference(epochs, None if args.backup else saved))
    pathlib.Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
