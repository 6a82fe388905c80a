"""tfmp under MirroredStrategy on two logical CPU devices; run by test_distribute.py.

    python tests/_dist_case.py --out result.json CASE [CASE ...]

The logical devices must be configured before TensorFlow initializes its devices,
hence a process of its own. Each case trains a tiny model and returns what it
measured (per-replica copies of the optimizer variables, weights, warnings); the
results go to ``--out`` as ``{case: result}``, a case that raised as
``{case: {"error": traceback}}`` so that only its own test fails.

Set-up shared by the cases: `mixed_float16`, SGD(0.01), initial scale 2**10,
`dynamic_growth_steps=2`, global batches of 8 split 4 + 4 over the two replicas,
and an inf in row 6 of batch 1, which lands in replica 1's half only.
"""

import argparse
import contextlib
import functools
import json
import os
import pathlib
import sys
import tempfile
import traceback
import warnings

import tensorflow as tf

REPLICAS = 2
BATCH = 8
BAD_BATCH, BAD_ROW = 1, 6  # row 6 of a global batch of 8 goes to replica 1


def two_cpu_devices():
    """Splits the CPU into REPLICAS logical devices (before TF initializes them)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )


two_cpu_devices()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _dist_train import LEARNING_RATE  # noqa: E402
from _dist_train import LSO_OPTIONS  # noqa: E402
from _dist_train import STATE  # noqa: E402
from _dist_train import arrays  # noqa: E402
from _dist_train import build_model  # noqa: E402
from _dist_train import custom_step  # noqa: E402
from _dist_train import local  # noqa: E402
from _dist_train import state  # noqa: E402
from _dist_train import weights  # noqa: E402

import tfmp  # noqa: E402
from tfmp._src.float32 import fused_batchnorm  # noqa: E402
from tfmp._src.keras_hooks import train_function  # noqa: E402


@functools.cache
def mirrored():
    """The process's one MirroredStrategy over the logical CPUs.

    One instance for all cases: each new instance numbers its collective ops from
    the same key, and TF's collective executor then mixes up the instances.
    """
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])


def data(batches=4, bad=True):
    """`batches` global batches of BATCH rows; with `bad`, replica 1's inf."""
    x, y = arrays(batches * BATCH, BAD_BATCH * BATCH + BAD_ROW if bad else None)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def sgd():
    return keras.optimizers.SGD(LEARNING_RATE)


@contextlib.contextmanager
def keras_float16():
    """Keras's own mixed_float16 policy, without tfmp's compile hook."""
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


class Record(keras.callbacks.Callback):
    """Per-replica optimizer state and weights after every batch."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        opt = self.model.optimizer
        self.batches.append(
            {
                "state": state(self.strategy, opt),
                "iterations": int(opt.iterations.numpy()),
                "weights": weights(self.strategy, self.model),
                "loss": float(logs["loss"]),
            }
        )


def case_fit(tmp):
    """tfmp.enable() + model built and compiled in scope, trained with fit."""
    strategy = mirrored()
    finite_per_replica = []
    finite_on_replicas = tf.function(
        lambda v: strategy.run(lambda x: tf.reduce_all(tf.math.is_finite(x)), (v,))
    )
    for x, _ in strategy.experimental_distribute_dataset(data()):
        finite = finite_on_replicas(x)
        finite_per_replica.append(
            [bool(f) for f in strategy.experimental_local_results(finite)]
        )
    with tfmp.policy_scope("mixed_float16", loss_scale_options=LSO_OPTIONS):
        with strategy.scope():
            model = build_model()
            model.compile(sgd(), "mse")
        initial = weights(strategy, model)
        record = Record(strategy)
        model.fit(data(), epochs=1, verbose=0, callbacks=[record])
    return {
        "optimizer": type(model.optimizer).__name__,
        "optimizer_module": type(model.optimizer).__module__,
        "replicas": strategy.num_replicas_in_sync,
        "finite_per_replica": finite_per_replica,
        "initial_weights": initial,
        "batches": record.batches,
        "stuck_check": train_function.has_check(model, "stuck"),
    }


def case_keras_lso(tmp):
    """The same data with Keras's own LossScaleOptimizer (no tfmp)."""
    strategy = mirrored()
    with keras_float16(), strategy.scope():
        model = build_model()
        opt = keras.optimizers.LossScaleOptimizer(sgd(), **LSO_OPTIONS)
        model.compile(opt, "mse")
    model.fit(data().take(BAD_BATCH + 1), epochs=1, verbose=0)
    return {
        "iterations": int(opt.iterations.numpy()),
        "scale": local(strategy, opt.dynamic_scale),
        "weights_finite": all(np.isfinite(w).all() for w in model.get_weights()),
    }


def case_custom_loop(tmp):
    """strategy.run + tfmp.scaled_gradients, inf fed to one chosen replica."""
    strategy = mirrored()
    with keras_float16(), strategy.scope():
        model = build_model()
        opt = tfmp.LossScaleOptimizer(sgd(), **LSO_OPTIONS)
        opt.build(model.trainable_variables)
    step = custom_step(strategy, model, opt, BATCH)
    steps = []
    for bad_replica in (1, 0, None):
        shards = [
            arrays(BATCH // REPLICAS, 0 if replica == bad_replica else None)
            for replica in range(REPLICAS)
        ]
        x, y = (
            strategy.experimental_distribute_values_from_function(
                lambda ctx, i=i, shards=shards: shards[ctx.replica_id_in_sync_group][i]
            )
            for i in (0, 1)
        )
        before = weights(strategy, model)
        step(x, y)
        steps.append(
            {
                "bad_replica": bad_replica,
                "weights_before": before,
                "weights_after": weights(strategy, model),
                "state": state(strategy, opt),
                "iterations": int(opt.iterations.numpy()),
            }
        )
    return {"steps": steps}


def _fit_two_steps(model):
    model.fit(data(batches=2, bad=False), epochs=1, verbose=0)
    return {
        "jit_compile": model.jit_compile,
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights_finite": all(np.isfinite(w).all() for w in model.get_weights()),
    }


def case_xla(tmp):
    """jit_compile=True: turned off with a warning under enable(), else refused."""
    strategy = mirrored()
    result = {}
    with tfmp.policy_scope("mixed_float16", loss_scale_options=LSO_OPTIONS):
        with strategy.scope():
            model = build_model()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.compile(sgd(), "mse", jit_compile=True)
        result["enabled"] = _fit_two_steps(model)
        result["enabled"]["warnings"] = [
            [w.category.__name__, str(w.message), os.path.basename(w.filename)]
            for w in caught
        ]
    with keras_float16():
        with strategy.scope():
            model = build_model()
            opt = tfmp.LossScaleOptimizer(sgd(), **LSO_OPTIONS)
            model.compile(opt, "mse", jit_compile=True)
        try:
            model.fit(data(batches=2, bad=False), epochs=1, verbose=0)
            result["manual"] = {"error": None}
        except ValueError as error:  # the refusal under test
            result["manual"] = {"error": type(error).__name__, "message": str(error)}
    result["manual"]["iterations"] = int(opt.iterations.numpy()) if opt.built else 0
    return result


def _plain_state(optimizer):
    return {name: getattr(optimizer, name).numpy().item() for name in STATE}


def case_checkpoint(tmp):
    """Save under MirroredStrategy, resume without one, and the other way round."""
    strategy = mirrored()
    out = {}
    with tfmp.policy_scope("mixed_float16", loss_scale_options=LSO_OPTIONS):
        # 1. Trained under MirroredStrategy (steps 0-1, step 1 overflows), saved.
        with strategy.scope():
            model = build_model()
            model.compile(sgd(), "mse")
        model.fit(data().take(2), epochs=1, verbose=0)
        out["saved_mirrored"] = _plain_state(model.optimizer)
        out["saved_weights"] = [w.tolist() for w in model.get_weights()]
        model.save(tmp / "mirrored.keras")
        ckpt_path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
            str(tmp / "mirrored_ckpt")
        )
        # Uninterrupted: steps 2-3 under the strategy.
        model.fit(data().skip(2), epochs=1, verbose=0)
        out["uninterrupted"] = _plain_state(model.optimizer)
        out["uninterrupted_weights"] = [w.tolist() for w in model.get_weights()]
    # 2a. Resumed without a strategy from the .keras file.
    loaded = keras.models.load_model(tmp / "mirrored.keras")
    out["loaded_class"] = type(loaded.optimizer).__name__
    out["loaded_state"] = _plain_state(loaded.optimizer)
    loaded.fit(data().skip(2), epochs=1, verbose=0)
    out["resumed_state"] = _plain_state(loaded.optimizer)
    out["resumed_weights"] = [w.tolist() for w in loaded.get_weights()]
    # 2b. Resumed without a strategy from the tf.train.Checkpoint.
    with keras_float16():
        plain = build_model()
        opt = tfmp.LossScaleOptimizer(sgd(), **LSO_OPTIONS)
        opt.build(plain.trainable_variables)
    restore = tf.train.Checkpoint(model=plain, optimizer=opt).restore(ckpt_path)
    restore.assert_consumed()
    out["restored_state"] = _plain_state(opt)
    # 3. Trained without a strategy (one more step), saved, loaded under the strategy.
    plain.compile(opt, "mse")
    plain.fit(data().skip(2).take(1), epochs=1, verbose=0)
    out["saved_plain"] = _plain_state(opt)
    plain.save(tmp / "plain.keras")
    with strategy.scope():
        into_mirrored = keras.models.load_model(tmp / "plain.keras")
    out["into_mirrored_state"] = state(strategy, into_mirrored.optimizer)
    into_mirrored.fit(data(bad=False).take(1), epochs=1, verbose=0)
    out["into_mirrored_after_step"] = state(strategy, into_mirrored.optimizer)
    out["into_mirrored_weights"] = weights(strategy, into_mirrored)
    return out


def _divide_model():
    """Dense -> Lambda dividing by input feature 0 -> Dense (test_numerics.py's model)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="d1")(inputs)
    ratio = keras.layers.Lambda(lambda ts: ts[0] / ts[1][:, :1], name="divide")(
        [hidden, inputs]
    )
    outputs = keras.layers.Dense(2, name="d2")(ratio)
    return keras.Model(inputs, outputs, name="net")


def _sqrt_model():
    """Dense d1 (weights 1, bias 0) -> Lambda sqrt(|x|) -> Dense d2.

    A zero input row makes d1's output 0, where sqrt's gradient is infinite and
    |x|'s is 0: the forward pass stays finite, d1's gradients turn NaN.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="d1", kernel_initializer="ones")(inputs)
    root = keras.layers.Lambda(lambda t: keras.ops.sqrt(keras.ops.abs(t)), name="sqrt")(
        hidden
    )
    return keras.Model(inputs, keras.layers.Dense(2, name="d2")(root), name="net")


def _numerics_data(*edits, steps=6):
    """Inputs in [1, 2), one global batch per step; each edit `(step, row, column, value)`.

    Rows 0-3 of a global batch go to replica 0, rows 4-7 to replica 1.
    """
    rng = np.random.RandomState(0)
    x = rng.uniform(1.0, 2.0, (steps * BATCH, 4)).astype("float32")
    y = rng.uniform(0.0, 1.0, (steps * BATCH, 2)).astype("float32")
    for step, row, column, value in edits:
        x[step * BATCH + row, column] = value
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def _copies(strategy, variable):
    """Each local replica's copy of a tf.Variable, as Python values."""
    return [
        np.asarray(copy.numpy()).tolist()
        for copy in strategy.experimental_local_results(variable)
    ]


def _numerics_run(strategy, dataset, run_eagerly=False, build=_divide_model, **options):
    """Trains `build()` under `strategy` with check_numerics; what it reported."""
    with strategy.scope():
        model = build()
        model.compile(sgd(), "mse", run_eagerly=run_eagerly)
    handle = tfmp.check_numerics(model, **options)
    raised = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.fit(dataset, epochs=1, verbose=0)
        except tfmp.NonFiniteError as error:  # the report under test
            raised.append(error)
    return {
        "raised": [
            [e.layer, e.phase, e.step, e.kind, [item["step"] for item in e.details["trace"]]]
            for e in raised
        ],
        "failures": [[e.layer, e.phase, e.step, e.kind] for e in handle.failures],
        "failures_are_raised": [f is e for f, e in zip(handle.failures, raised)],
        "warnings": sum(issubclass(w.category, RuntimeWarning) for w in caught),
        "input_range": [e.details.get("input_range") for e in handle.failures[:1]],
        "variable": [
            [e.details.get("variable"), e.details["bad_gradients"]]
            for e in handle.failures[:1]
        ],
        "step_copies": _copies(strategy, handle.recorder.step),
        "state_copies": _copies(strategy, handle.recorder.state),
    }


def case_numerics(tmp):
    """tfmp.check_numerics on two replicas: step, layer and one report per failure."""
    strategy = mirrored()

    def finite_per_replica(dataset):
        run = tf.function(
            lambda v: strategy.run(lambda x: tf.reduce_all(tf.math.is_finite(x)), (v,))
        )
        return [
            [bool(f) for f in strategy.experimental_local_results(run(x))]
            for x, _ in strategy.experimental_distribute_dataset(dataset)
        ]

    zero_on_1 = _numerics_data((4, 6, 0, 0.0))  # divide sees a zero on replica 1
    nan_on_1 = _numerics_data((3, 5, 2, np.nan))  # d1 sees a NaN on replica 1
    return {
        "nan_on_1_finite": finite_per_replica(nan_on_1),
        "zero_on_1": _numerics_run(strategy, zero_on_1),
        "zero_on_0": _numerics_run(strategy, _numerics_data((4, 2, 0, 0.0))),
        "zero_on_1_eager": _numerics_run(strategy, zero_on_1, run_eagerly=True),
        "nan_on_1": _numerics_run(strategy, nan_on_1),
        # Step 4: divide fails on replica 0, d1 (an earlier layer) on replica 1.
        "both": _numerics_run(
            strategy, _numerics_data((4, 2, 0, 0.0), (4, 5, 2, np.nan))
        ),
        # Step 0: a zero row on replica 1 turns d1's gradients NaN there only.
        "backward": _numerics_run(
            strategy,
            _numerics_data(*[(0, 6, column, 0.0) for column in range(4)]),
            build=_sqrt_model,
            phase="backward",
        ),
        "warn": _numerics_run(strategy, zero_on_1, action="warn"),
    }


class _KLTerm(keras.layers.Layer):
    """Adds a 16-bit loss term (as the Keras VAE example's KL term), returns its input."""

    def call(self, x):
        self.add_loss(1e-3 * tf.reduce_mean(tf.square(x)))
        return x


def case_replica_graphs(tmp):
    """A model attached in a scope, traced after it in the replica threads."""
    strategy = mirrored()
    with tfmp.policy_scope("mixed_bfloat16"):
        with strategy.scope():
            inputs = keras.Input((4, 4, 3))
            x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
            x = keras.layers.BatchNormalization(name="bn")(x)
            x = _KLTerm()(x)
            outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x))
            model = keras.Model(inputs, outputs)
            model.compile(sgd(), "mse")
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((16, 4, 4, 3), "float32"), np.zeros((16, 2), "float32"))).batch(BATCH)
    history = model.fit(data, epochs=1, verbose=0)  # the KL term is summed in float32
    bn = model.get_layer("bn")
    step = tf.function(lambda v: strategy.run(lambda t: bn(t, training=True), (v,)))
    graph = step.get_concrete_function(tf.TensorSpec((8, 4, 4, 4), "bfloat16")).graph
    ops = [op.type for op in graph.get_operations()]
    return {
        "loss": float(history.history["loss"][-1]),
        "fused_ops": ops.count("FusedBatchNormV3"),
        "last_call_reason": fused_batchnorm.last_call_reason(bn),
        "replicas": strategy.num_replicas_in_sync,
    }


class LowGain(keras.layers.Layer):
    """Stores its gain in the compute dtype (16 bits under a mixed policy)."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(input_shape[-1],), initializer="ones", dtype=self.compute_dtype,
                                    name="gain")

    def call(self, x):
        return x * keras.ops.cast(self.gain, x.dtype)


def case_master_copies(tmp):
    """mixed_bfloat16, Adam: a 16-bit gain's float32 copy per replica, and the gain without a strategy."""
    pairs = {}
    for name, strategy in (("mirrored", mirrored()), ("alone", tf.distribute.get_strategy())):
        with tfmp.policy_scope("mixed_bfloat16"), strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), LowGain(name="scale"), keras.layers.Dense(1)])
            model.compile(keras.optimizers.Adam(1e-2), "mse")
            model.fit(data(bad=False), epochs=2, verbose=0)
        (pairs[name],) = model.optimizer.master_copies.pairs
    (variable, copy), (alone, _) = pairs["mirrored"], pairs["alone"]

    def per_replica(v):
        return [np.asarray(x.numpy(), "float32").tolist() for x in mirrored().experimental_local_results(v.value)]

    return {
        "copy_per_replica": per_replica(copy),
        "gain_per_replica": per_replica(variable),
        "gain_alone": np.asarray(alone.numpy(), "float32").tolist(),
        "dtypes": [variable.dtype, copy.dtype],
    }


CASES = {
    "replica_graphs": case_replica_graphs,
    "fit": case_fit,
    "keras_lso": case_keras_lso,
    "custom_loop": case_custom_loop,
    "xla": case_xla,
    "checkpoint": case_checkpoint,
    "numerics": case_numerics,
    "master_copies": case_master_copies,
}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # float16 on a CPU
    results = {}
    for name in args.cases:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                results[name] = CASES[name](pathlib.Path(tmp))
            except Exception:  # reported to the test of this case, which fails
                results[name] = {"error": traceback.format_exc()}
        keras.backend.clear_session()
    pathlib.Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
