"""The watchdog process of `tfmp.multi_worker_strategy`; standard library only, so it starts in milliseconds.

Run as ``python cluster_watchdog.py SETTINGS_JSON`` by `tfmp._src.cluster`: the worker
closes the watchdog's stdin once the cluster formed, and it exits quietly. Past the
timeout it writes which task is missing to the worker's stderr and ends the worker with
SIGKILL: TensorFlow's wait holds the GIL and ignores SIGTERM.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
from typing import Dict, List, Sequence, Tuple

#: Jobs whose tasks the strategy waits for (TensorFlow's coordinated jobs).
COORDINATED_JOBS = ("chief", "worker")
_PROBE_TIMEOUT_S = 1.0


def peers(cluster: Dict[str, List[str]], task: Sequence) -> List[Tuple[str, int, str]]:
    """(job, index, address) of every task the strategy waits for, but `task` (job, index)."""
    return [(job, index, address) for job in COORDINATED_JOBS
            for index, address in enumerate(cluster.get(job, []))
            if (job, index) != (task[0], task[1])]


def answers(address: str) -> bool:
    """Bool. Whether a TCP server accepts a connection at ``host:port`` now."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def timeout_message(cluster: Dict[str, List[str]], task: Sequence, timeout_s: float,
                    silent: Sequence[Sequence]) -> str:
    """The text written to the worker's stderr when its cluster did not form in time.

    `cluster` is ``TF_CONFIG``'s, `task` the worker's (job, index), `silent` the
    (job, index, address) of each peer where no server answered.
    """
    missing = ", ".join(f"{job} {index} at {address}" for job, index, address in silent) or (
        "none (every peer's server answers, but not every task joined: a task may have been "
        "started with another TF_CONFIG)")
    return (
        f"tfmp.multi_worker_strategy: the cluster of TF_CONFIG did not form within {timeout_s:g} s. "
        f"This process is {task[0]} {task[1]} of {cluster}. Peers where no server answers: {missing}. "
        "Start every task of TF_CONFIG's cluster with its own task type and index (the same "
        "cluster in each), check that each address is reachable from here, or pass a larger "
        "timeout_s. Ending this process (SIGKILL): TensorFlow waits for the whole cluster without "
        "a time limit and cannot be interrupted from Python.\n"
    )


def main(settings_json: str) -> int:
    settings = json.loads(settings_json)
    ready, _, _ = select.select([sys.stdin], [], [], settings["timeout_s"])
    if ready:  # the worker closed the pipe: the cluster formed, or it ended
        return 0
    silent = [peer for peer in peers(settings["cluster"], settings["task"]) if not answers(peer[2])]
    ready, _, _ = select.select([sys.stdin], [], [], 0)
    if ready:
        return 0
    sys.stderr.write(timeout_message(settings["cluster"], settings["task"], settings["timeout_s"], silent))
    sys.stderr.flush()
    os.kill(settings["pid"], signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
