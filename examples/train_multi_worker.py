"""Train the digits classifier with `model.fit` on several worker processes under tfmp.

TensorFlow's `MultiWorkerMirroredStrategy` runs one process per worker (one per
machine, or several on one machine); each trains on its share of every global
batch, and tfmp keeps one loss scale and one skip verdict per step across all of
them. Without ``TF_CONFIG`` this script starts ``--workers`` local worker
processes on loopback ports itself and waits for them; with ``TF_CONFIG`` set
(by Slurm, Kubernetes, Ray, or by hand) it is one worker of that cluster.

    python examples/train_multi_worker.py                       # 2 local workers, policy "auto"
    python examples/train_multi_worker.py --workers 3 --policy mixed_float16
    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]},
                "task": {"type": "worker", "index": 0}}' python examples/train_multi_worker.py
    tensorboard --logdir logs/multi_worker                      # the chief's loss scale and overflows

Every worker runs the same program: `tfmp.multi_worker_strategy()` first (it
starts this worker's server and waits, at most ``--cluster-timeout`` seconds, for
the others), `tfmp.enable()`, the model built and compiled in ``strategy.scope()``,
then `fit` on a `tf.data` dataset of global batches (``--batch-size`` examples per
worker) that the strategy splits by data.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

import example_args  # examples/, next to this file; imports no TensorFlow

#: What the chief prints last; the local launcher reads the accuracy back from it.
ACCURACY_LINE = "Multi-worker test accuracy"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train the digits classifier with model.fit under "
        "MultiWorkerMirroredStrategy and tfmp: starts local workers, or joins the "
        "cluster of TF_CONFIG."
    )
    parser.add_argument("--workers", type=example_args.positive_int, default=2,
                        help="local worker processes to start when TF_CONFIG is not set "
                        "(default 2)")
    parser.add_argument("--cluster-timeout", type=example_args.positive_int, default=120,
                        help="seconds each worker waits for the others to start (default 120)")
    example_args.add_training_args(parser, epochs=3, batch_size=32,
                                   log_dir=os.path.join("logs", "multi_worker"))
    return parser.parse_args(argv)


def free_ports(count: int) -> List[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def launch_local(args: argparse.Namespace, argv: Sequence[str]) -> float:
    """Starts `args.workers` workers of this script on loopback ports; returns the chief's accuracy.

    Each worker gets ``TF_CONFIG`` naming all of them and its own index; its output
    goes to a file, the chief's is printed at the end (a failed worker's instead,
    after the others are stopped).
    """
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(args.workers)]}
    deadline = time.monotonic() + args.cluster_timeout + 600
    with tempfile.TemporaryDirectory() as folder:
        workers = []
        for index in range(args.workers):
            env = dict(os.environ, TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}))
            log = open(pathlib.Path(folder) / f"worker{index}.log", "w+")
            process = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                                       env=env, stdout=log, stderr=subprocess.STDOUT)
            workers.append((process, log))
        print(f"Started {args.workers} workers on {', '.join(cluster['worker'])}; waiting for them.",
              flush=True)
        try:
            failed = None
            while failed is None and time.monotonic() < deadline:
                codes = [process.poll() for process, _ in workers]
                failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
                if None not in codes:
                    break
                time.sleep(0.2)
        finally:
            for process, _ in workers:
                if process.poll() is None:
                    process.kill()
                process.wait()
        shown = 0 if failed is None else failed
        process, log = workers[shown]
        log.seek(0)
        output = log.read()
        for _, other in workers:
            other.close()
    print(output, end="")
    if failed is not None or process.returncode != 0:
        raise SystemExit(f"Worker {shown} failed (exit status {process.returncode}); its output is above.")
    accuracy = [line for line in output.splitlines() if line.startswith(ACCURACY_LINE)]
    return float(accuracy[-1].rsplit(" ", 1)[-1])


def run_worker(args: argparse.Namespace) -> float:
    """One worker of the cluster in ``TF_CONFIG``; returns the test accuracy."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tfmp

    # First: the strategy configures TensorFlow's runtime for the cluster.
    strategy = tfmp.multi_worker_strategy(timeout_s=args.cluster_timeout)

    import keras
    import tensorflow as tf

    import example_utils  # noqa: F401  (examples/, next to this file; TensorFlow's log level)
    import train_digits

    decision = tfmp.enable(args.policy)
    resolver = strategy.cluster_resolver
    chief = resolver.task_type == "chief" or (
        resolver.task_type == "worker" and resolver.task_id == 0
        and "chief" not in resolver.cluster_spec().jobs)
    workers = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(args.seed)  # the same weights and shuffling on every worker

    (x_train, y_train), (x_test, y_test) = train_digits.load_digits_arrays(seed=args.seed)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    global_batch = args.batch_size * workers  # each worker gets --batch-size of every batch
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=args.seed)
    train = train.batch(global_batch).with_options(options)
    if args.steps:
        train = train.take(args.steps)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch).with_options(options)

    widths = train_digits.FLOAT16_DEMO_WIDTHS if decision.policy == "mixed_float16" else {}
    with strategy.scope():
        model = train_digits.build_model(x_train.shape[1:], **widths)
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    # The monitor writes on the chief only; the chief alone makes the run folder.
    log_dir = example_utils.new_run_dir(args.log_dir) if chief else args.log_dir
    model.fit(train, epochs=args.epochs, verbose=2 if chief else 0,
              callbacks=[tfmp.LossScaleMonitor(log_dir)])
    _, accuracy = model.evaluate(test, verbose=0)
    optimizer = model.optimizer
    if chief:
        scaling = "no tfmp.LossScaleOptimizer (float32 compute)"
        if isinstance(optimizer, tfmp.LossScaleOptimizer):
            scaling = (f"loss scale {float(optimizer.loss_scale):g}, "
                       f"{int(optimizer.overflow_count.numpy())} skipped steps")
        print(f"tfmp policy: {decision.policy}; {workers} workers; {scaling}")
        print(f"TensorBoard logs: tensorboard --logdir {args.log_dir} (this run: {log_dir})")
        print(f"{ACCURACY_LINE} ({decision.policy}): {accuracy:.4f}", flush=True)
    return float(accuracy)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Joins the cluster of ``TF_CONFIG``, or starts local workers; returns the test accuracy."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    example_args.require("sklearn", example_args.DIGITS_DATA)
    if os.environ.get("TF_CONFIG"):
        return run_worker(args)
    return launch_local(args, argv)


if __name__ == "__main__":
    main()
