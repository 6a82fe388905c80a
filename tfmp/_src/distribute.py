"""tfmp under `tf.distribute`: one loss scale and one verdict for all replicas.

Keras 3.15's `LossScaleOptimizer` checks each replica's local gradients and keeps replica
0's answer, so another replica's overflow reaches every weight (tests/test_distribute.py).
The helpers below combine such facts over all replicas in sync. XLA under several
replicas fails in Keras (keras-team/keras issue 21366): tfmp compiles such models without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Optional

import tensorflow as tf

from tfmp._src.errors import invalid_argument, warn
from tfmp._src.keras_hooks import multi_worker
from tfmp._src.keras_hooks.runtime_options import in_xla_context
from tfmp._src.policy.policy import PerformanceWarning


def replicas_in_sync(strategy: Optional[tf.distribute.Strategy] = None) -> int:
    """Int >= 1. Replicas that train in lockstep under `strategy` (None: the current one)."""
    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    return int(strategy.num_replicas_in_sync)


def is_chief(strategy: Optional[tf.distribute.Strategy] = None) -> bool:
    """Bool. Whether this process writes summaries and checkpoints (`strategy` None: the current one).

    True but on a multi-worker cluster's tasks other than the chief: the task of type
    ``"chief"``, or ``"worker"`` 0 when the cluster has no chief (TensorFlow's
    multi-worker guide). Asks `StrategyExtended.should_save_summary`, then the
    strategy's cluster resolver.

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
    return task_type == "worker" and task_id == 0 and "chief" not in resolver.cluster_spec().jobs


def replica_local_variable(
    initial: Any, *, dtype: Any = None, name: Optional[str] = None, strategy: Any = None
) -> tf.Variable:
    """A non-trainable variable with one copy per replica, read from the first.

    Each replica writes its own copy with no cross-replica synchronization, which an
    assignment inside `tf.cond` cannot do; a host read returns replica 0's. Made in
    `strategy`'s scope, or (None) in the caller's.
    """
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        return tf.Variable(initial, dtype=dtype, trainable=False, name=name,
                           synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def any_replica(flags: Sequence[Any]) -> list:
    """OR-s this replica's scalar bool `flags` over all replicas in sync, with one all-reduce.

    In a replica context every replica gets the same list; with one replica, or in a
    cross-replica context, the flags come back unchanged.
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
    """Every replica's float32 `value` (static shape `S`), as a `[replicas, *S]` table, with one all-reduce.

    Each replica writes its own row of a zero table and the tables are summed:
    ``x + 0 == x`` for every float32 ``x``, NaN and infinities included. With one
    replica, or in a cross-replica context, the table holds `value` alone.
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
    """Switches a compiled `model`'s explicit ``jit_compile=True`` off when it trains on several replicas.

    Returns:
        Bool. True when XLA was turned off.

    Warns:
        tfmp.PerformanceWarning: when XLA was turned off, saying why and how to keep it.
    """
    replicas = replicas_in_sync(model.distribute_strategy)
    if replicas == 1 or not model.jit_compile:
        return False
    warn(f"tfmp compiled model {model.name!r} with jit_compile=False: XLA cannot compile a step on {replicas} replicas.",
         "Keras XLA-compiles the whole strategy.run step, which fails in merge_call (keras-team/keras#21366).",
         "Fix: train on a single replica to keep XLA; jit_compile=False silences this.",
         PerformanceWarning, section="xla-turned-off")
    model.jit_compile = False
    return True


def check_not_xla_replicated() -> None:
    """Refuses, while tracing, an XLA-compiled step under a multi-replica strategy.

    Raises:
        ValueError: when the step being traced is XLA-compiled and runs in a
            replica context of a strategy with more than one replica.
    """
    context = tf.distribute.get_replica_context()
    replicas = 1 if context is None else context.num_replicas_in_sync
    if replicas == 1 or tf.executing_eagerly() or not in_xla_context():  # MirroredStrategy's own XLA test
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

    Keras's multi-step loop over a distributed iterator fails on every worker
    (TF 2.21 / Keras 3.15).

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

    There it refuses what cannot work (`check_multi_worker_fit`, again at each
    ``fit``) and installs `keras_hooks.multi_worker`'s fix; elsewhere it takes an
    earlier one off. Returns True when the fix is installed.

    Raises:
        ValueError: see `check_multi_worker_fit`.
    """
    if not multi_worker.is_multi_worker(getattr(model, "distribute_strategy", None)):
        multi_worker.remove(model)
        return False
    check_multi_worker_fit(model)
    multi_worker.install(model, check_multi_worker_fit)
    return True
