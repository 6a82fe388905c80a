"""tfmp under `tf.distribute`: one loss scale and one verdict for all replicas.

Under `tf.distribute.MirroredStrategy` and `MultiWorkerMirroredStrategy` every replica
updates its own copy of each optimizer variable (``aggregation="none"``); the copies stay
equal only while every replica takes the same branch. Keras 3.15's `LossScaleOptimizer`
checks each replica's local gradients before the all-reduce and keeps replica 0's answer,
so an overflow on another replica's shard reaches every weight uncounted
(tests/test_distribute.py). The helpers below combine such facts over all replicas in
sync: every replica skips the same steps, holds the same scale, counts each skip once.
XLA under a multi-replica strategy fails in Keras (keras-team/keras issue 21366), so
tfmp compiles such models without it, with a warning, and refuses an XLA step it did
not compile.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import tensorflow as tf

from tfmp._src.errors import invalid_argument, user_stacklevel
from tfmp._src.keras_hooks import multi_worker
from tfmp._src.keras_hooks.runtime_options import in_xla_context
from tfmp._src.policy.policy import PerformanceWarning


def replicas_in_sync(strategy: Optional[tf.distribute.Strategy] = None) -> int:
    """Int >= 1. Replicas that train in lockstep under `strategy`.

    Args:
        strategy: `tf.distribute.Strategy` or None for the current one (the default
            strategy, with 1 replica, outside any ``scope()``).
    """
    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    return int(strategy.num_replicas_in_sync)


def is_chief(strategy: Optional[tf.distribute.Strategy] = None) -> bool:
    """Whether this process is the one that writes summaries and checkpoints.

    True without a strategy, under single-process strategies (`MirroredStrategy`,
    `OneDeviceStrategy`) and on the chief of a multi-worker cluster: the task of
    type ``"chief"``, or ``"worker"`` 0 when the cluster has no chief (the
    `TF_CONFIG` convention of TensorFlow's multi-worker guide). It asks the strategy
    first (`StrategyExtended.should_save_summary`, which `MultiWorkerMirroredStrategy`
    answers this way), then its cluster resolver.

    Args:
        strategy: `tf.distribute.Strategy` or None for the current one.

    Returns:
        Bool.

    Example:
        >>> is_chief()
        True
    """
    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    try:
        return bool(strategy.extended.should_save_summary)
    except NotImplementedError:  # strategies that leave the property abstract
        pass
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type in (None, "chief"):
        return True
    has_chief = "chief" in resolver.cluster_spec().jobs
    return task_type == "worker" and task_id == 0 and not has_chief


def replica_local_variable(
    initial: Any, *, dtype: Any = None, name: Optional[str] = None, strategy: Any = None
) -> tf.Variable:
    """A non-trainable variable with one copy per replica, read from the first.

    ``synchronization=ON_READ`` gives every replica of a `tf.distribute` strategy its
    own copy, written from its replica context only (no cross-replica
    synchronization, which an assignment inside `tf.cond` cannot do);
    ``ONLY_FIRST_REPLICA`` makes a host read (cross-replica context) return replica
    0's copy. Without a strategy it is a plain variable.

    Args:
        initial: Initial value (tensor, array or Python number).
        dtype: `tf.DType` or None (from `initial`).
        name: String or None.
        strategy: `tf.distribute.Strategy` whose scope creates it, or None for the
            scope the caller is in.
    """
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        return tf.Variable(
            initial,
            dtype=dtype,
            trainable=False,
            name=name,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )


def any_replica(flags: Sequence[Any]) -> list:
    """OR-s boolean flags over all replicas in sync, with one all-reduce.

    Call it in a replica context (inside ``strategy.run`` or Keras's train step);
    every replica then gets the same answers. With one replica, or in a cross-replica
    context, the flags come back unchanged.

    Args:
        flags: Sequence of scalar bool tensors, this replica's facts.

    Returns:
        List of scalar bool tensors: True where any replica's flag was True.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(flags)
    # A float32 sum: every cross-device implementation (rings, NCCL) reduces it.
    counts = context.all_reduce(
        tf.distribute.ReduceOp.SUM, [tf.cast(flag, tf.float32) for flag in flags]
    )
    return [tf.greater(count, 0.0) for count in counts]


def all_replicas_finite(finite: Any) -> Any:
    """Scalar bool tensor: True when `finite` is True on every replica in sync."""
    (non_finite,) = any_replica([tf.logical_not(finite)])
    return tf.logical_not(non_finite)


def gather_replicas(value: Any) -> Any:
    """Every replica's `value`, stacked in replica order, with one all-reduce.

    Call it in a replica context; every replica then gets the same table. Each
    replica writes its value into its own row of a zero table and the tables are
    summed: every entry is its one replica's value plus zeros, and ``x + 0 == x``
    for every float32 ``x``, infinities and NaN included, so non-finite values
    arrive unchanged. With one replica, or in a cross-replica context, the table
    holds `value` alone.

    Args:
        value: Float32 tensor of a static shape `S`, the same on every replica.

    Returns:
        Float32 tensor of shape `[replicas, *S]`; row `r` is replica `r`'s value
        (`replica_id_in_sync_group`).
    """
    value = tf.convert_to_tensor(value, tf.float32)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value[None]
    replicas = context.num_replicas_in_sync
    index = tf.reshape(tf.cast(context.replica_id_in_sync_group, tf.int32), [1, 1])
    table = tf.scatter_nd(index, value[None], [replicas, *value.shape.as_list()])
    return context.all_reduce(tf.distribute.ReduceOp.SUM, table)


def _xla_refusal(replicas: int) -> str:
    return (
        f"XLA (jit_compile=True) cannot compile a training step replicated over "
        f"{replicas} replicas of a tf.distribute strategy: Keras XLA-compiles the "
        "whole strategy.run step, which either cannot reach the other devices' "
        "variables or fails in merge_call (keras-team/keras issue 21366)."
    )


def turn_off_xla_if_replicated(model: Any) -> bool:
    """Switches `model.jit_compile` off when the model trains on several replicas.

    Called by the compile hook of `tfmp.enable()` after Keras's `compile`, before
    any train function exists. Keras's ``jit_compile="auto"`` already resolves to
    False under a strategy, so this only overrides an explicit True.

    Args:
        model: `keras.Model`, compiled.

    Returns:
        Bool. True when XLA was turned off.

    Warns:
        tfmp.PerformanceWarning: when XLA was turned off, saying why and how to keep
            XLA (train on one replica).
    """
    replicas = replicas_in_sync(model.distribute_strategy)
    if replicas == 1 or not model.jit_compile:
        return False
    warnings.warn(
        _xla_refusal(replicas)
        + f" tfmp compiled model {model.name!r} with jit_compile=False instead; "
        "the step runs as a tf.function graph. To keep XLA, train on a single "
        "replica.",
        PerformanceWarning,
        stacklevel=user_stacklevel(),  # the caller of Model.compile
    )
    model.jit_compile = False
    return True


def check_not_xla_replicated() -> None:
    """Refuses an XLA-compiled step under a multi-replica strategy.

    Called by `tfmp.LossScaleOptimizer.apply` while a step is being traced, so the
    refusal comes before any step runs and instead of TensorFlow's tracebacks.

    Raises:
        ValueError: when the step being traced is XLA-compiled and runs in a
            replica context of a strategy with more than one replica.
    """
    context = tf.distribute.get_replica_context()
    replicas = 1 if context is None else context.num_replicas_in_sync
    if replicas == 1 or tf.executing_eagerly():
        return
    # The test MirroredStrategy itself uses to choose its merge-call path.
    if not in_xla_context():
        return
    raise ValueError(
        _xla_refusal(replicas) + " Compile the model with jit_compile=False, or "
        "call tfmp.enable() before compile(): it turns XLA off for such models "
        "with a warning."
    )


def workers(strategy: Any) -> int:
    """Int >= 1. Worker processes `strategy` spans (1 for single-process strategies)."""
    if not multi_worker.is_multi_worker(strategy):
        return 1
    return int(strategy.num_replicas_in_sync) // max(1, len(strategy.extended.worker_devices))


def check_multi_worker_fit(model: Any) -> None:
    """Refuses what ``fit`` / ``evaluate`` cannot do under a multi-worker strategy.

    ``steps_per_execution`` > 1: Keras's multi-step loop (a ``tf.while_loop``
    over ``get_next_as_optional`` of a distributed iterator) fails inside its
    first execution on every worker (an ``InvalidArgumentError`` from a
    placeholder of the loop's condition; measured on TF 2.21 / Keras 3.15).

    Args:
        model: `keras.Model`, compiled.

    Raises:
        ValueError: (template) ``steps_per_execution`` > 1 under a strategy of
            several workers, naming the fix (compile with 1).
    """
    strategy = model.distribute_strategy
    steps = getattr(model, "steps_per_execution", 1)
    if steps == 1 or not multi_worker.is_multi_worker(strategy):
        return
    raise invalid_argument(
        "steps_per_execution", steps,
        f"1 for model {model.name!r} under tf.distribute.MultiWorkerMirroredStrategy across "
        f"{workers(strategy)} workers: Keras runs several steps per call in a tf.while_loop over "
        "the distributed iterator, which fails on every worker before the first step",
        fix="Compile with steps_per_execution=1 (the default); each worker then runs one step per "
        "call and the workers' collective ops overlap the host's work.",
    )


def prepare_multi_worker(model: Any) -> bool:
    """Makes ``fit`` and ``evaluate`` of `model` work under a multi-worker strategy.

    Called when tfmp attaches a model (compile or load while enabled). Under a
    strategy of several workers it refuses what cannot work
    (`check_multi_worker_fit`, again at each ``fit`` / ``evaluate``) and installs
    `tfmp._src.keras_hooks.multi_worker`'s fix, which acts only where Keras's own
    code fails; elsewhere it takes an earlier one off.

    Args:
        model: `keras.Model`.

    Returns:
        Bool. True when the fix is installed.

    Raises:
        ValueError: see `check_multi_worker_fit`.
    """
    if not multi_worker.is_multi_worker(getattr(model, "distribute_strategy", None)):
        multi_worker.remove(model)
        return False
    check_multi_worker_fit(model)
    multi_worker.install(model, check_multi_worker_fit)
    return True
