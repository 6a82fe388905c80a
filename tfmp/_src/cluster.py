"""Joining a multi-worker cluster in bounded time: `tfmp.multi_worker_strategy`.

`tf.distribute.MultiWorkerMirroredStrategy()` waits inside TensorFlow's runtime, with
no time limit Python can interrupt, until every task has connected (details:
docs/guides/distributed.md, "Several worker processes"). `multi_worker_strategy`
creates it under a watchdog process (`tfmp._src.cluster_watchdog`) that ends the worker past `timeout_s`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import tensorflow as tf

from tfmp._src import cluster_watchdog
from tfmp._src.errors import check_positive_number, check_type


def multi_worker_strategy(
    timeout_s: float = 300.0,
    *,
    communication_options: Optional[tf.distribute.experimental.CommunicationOptions] = None,
) -> tf.distribute.MultiWorkerMirroredStrategy:
    """`tf.distribute.MultiWorkerMirroredStrategy` from ``TF_CONFIG``, failing in bounded time.

    Creates the strategy exactly as ``tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=...)`` does. Call it in every worker at program start,
    before any other TensorFlow work (`tfmp.enable()` may come before or after it).
    TensorFlow then waits until every ``"chief"`` and ``"worker"`` task of the
    cluster has started. If the cluster has not formed after `timeout_s`, a
    watchdog process writes to stderr which peers' addresses no server answers and
    how to fix it, and ends this process with SIGKILL (exit status -9, 137 in a
    shell): TensorFlow's wait cannot be interrupted, so no exception can be raised.
    Without a cluster in ``TF_CONFIG`` (or with one task) nothing is waited for.

    Args:
        timeout_s: Float > 0. Seconds to wait for every task to start (default
            300).
        communication_options: `tf.distribute.experimental.CommunicationOptions`
            or None, passed to the strategy (e.g. ``timeout_seconds`` for each
            collective op once training runs).

    Returns:
        `tf.distribute.MultiWorkerMirroredStrategy`.

    Raises:
        ValueError: (template) `timeout_s` not a finite number > 0, or
            `communication_options` not a `CommunicationOptions`.

    Example (in each worker, ``TF_CONFIG`` set by the launcher)::

        strategy = tfmp.multi_worker_strategy(timeout_s=120)
        tfmp.enable()
        with strategy.scope():
            model = build_model()
            model.compile("adam", "sparse_categorical_crossentropy")
        model.fit(dataset, epochs=3)
    """
    check_positive_number("timeout_s", timeout_s, fix="Pass e.g. timeout_s=300.0 (the default).")
    check_type("communication_options", communication_options,
               tf.distribute.experimental.CommunicationOptions,
               "a tf.distribute.experimental.CommunicationOptions", allow_none=True,
               fix="Pass e.g. communication_options=tf.distribute.experimental.CommunicationOptions("
               "timeout_seconds=60), or None.")
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = {job: list(tasks) for job, tasks in resolver.cluster_spec().as_dict().items()}
    task = [resolver.task_type, resolver.task_id]
    if not cluster_watchdog.peers(cluster, task):
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=communication_options)
    settings = {"cluster": cluster, "task": task, "timeout_s": float(timeout_s), "pid": os.getpid()}
    watchdog = subprocess.Popen(
        [sys.executable, cluster_watchdog.__file__, json.dumps(settings)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
    )
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=communication_options)
    finally:
        watchdog.stdin.close()  # the cluster formed (or creating the strategy raised)
        watchdog.wait()
