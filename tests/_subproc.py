"""Runs helper scripts of the test suite in Python processes of their own.

Some set-ups must happen before TensorFlow initializes its devices (two logical CPU
devices for `MirroredStrategy`, `TF_CONFIG` for `MultiWorkerMirroredStrategy`), which
the pytest process did long ago. Such cases live in scripts under tests/ that write
their findings as JSON to the file named by ``--out``; the helpers here start them
with this interpreter and this checkout on `PYTHONPATH`, bound each wait by a
timeout and always kill what they started, also when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Iterator, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def script_env(extra: Optional[dict] = None) -> dict:
    """Environment for a helper script: this checkout first on PYTHONPATH, TF quiet."""
    env = dict(os.environ)
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra or {})
    return env


#: The examples' message when scikit-learn is missing (examples/example_args.py).
MISSING_SKLEARN = (
    "Missing optional package 'scikit-learn' (module 'sklearn'). Expected it "
    "installed: the digits data set (scikit-learn's bundled handwritten digits) "
    "needs it, and tfmp's 'examples' extra installs it. Received: "
    "ModuleNotFoundError: No module named 'sklearn'. Install it with: "
    'pip install "tfmp[examples]" (from a checkout of tfmp: pip install ".[examples]").'
)

_NOT_INSTALLED = """import sys


class NotInstalled:
    \"\"\"Ends the search for {module!r} as the import system does when it is not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""


def without_module(folder: pathlib.Path, module: str) -> str:
    """A folder whose ``sitecustomize`` makes ``import <module>`` fail at start-up.

    Put it first on `PYTHONPATH` of a new interpreter: every import of `module`
    (or of a submodule) then raises the ModuleNotFoundError Python raises for a
    package that is not installed, whichever folder would have provided it.

    Args:
        folder: `pathlib.Path`. An empty folder to write ``sitecustomize.py`` into.
        module: String. Top-level module name, e.g. ``"sklearn"``.

    Returns:
        String. `folder`, for `PYTHONPATH`.
    """
    (folder / "sitecustomize.py").write_text(_NOT_INSTALLED.format(module=module))
    return str(folder)


def free_ports(count: int) -> list:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        sockets = [
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            for _ in range(count)
        ]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


@contextlib.contextmanager
def started(
    script: str, runs: Sequence[tuple], out_dir: pathlib.Path
) -> Iterator[list]:
    """Starts `script` once per run; on exit kills every process still running.

    Args:
        script: File name under tests/, e.g. ``"_mw_worker.py"``.
        runs: Sequence of ``(args, env_extra)``: command-line arguments (list of
            str) and extra environment variables (dict) of each process.
        out_dir: Folder for each process's JSON result and stderr log.

    Yields:
        List of ``(process, out_path, log_path)``.
    """
    launched = []
    try:
        for index, (args, env_extra) in enumerate(runs):
            out_path = out_dir / f"result{index}.json"
            log_path = out_dir / f"stderr{index}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [
                        sys.executable,
                        str(TESTS / script),
                        "--out",
                        str(out_path),
                        *args,
                    ],
                    cwd=str(out_dir),
                    env=script_env(env_extra),
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            launched.append((process, out_path, log_path))
        yield launched
    finally:
        for process, _, _ in launched:
            if process.poll() is None:
                process.kill()
            process.wait()


def results(launched: Sequence[tuple], timeout_s: float) -> list:
    """Waits for every process (`timeout_s` in all) and returns their JSON results.

    Stops waiting as soon as one process fails: its peers (e.g. the other worker of
    a cluster) may otherwise wait for it until the timeout.

    Raises:
        AssertionError: a process timed out or failed; the message holds the tail of
            its stderr.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [process.poll() for process, _, _ in launched]
        if any(code not in (None, 0) for code in codes) or None not in codes:
            break
        time.sleep(0.2)
    # A process that failed explains more than a peer still waiting for it.
    for process, _, log_path in sorted(launched, key=lambda r: r[0].poll() is None):
        code = process.poll()
        if code != 0:
            tail = log_path.read_text(errors="replace")[-4000:]
            status = "timed out" if code is None else f"exited with {code}"
            raise AssertionError(f"{process.args[1]} {status}:\n{tail}")
    return [json.loads(out_path.read_text()) for _, out_path, _ in launched]



def plain_keras_load(path: pathlib.Path, tmp_path: pathlib.Path) -> dict:
    """Loads the `.keras` file `path` in a process that cannot import tfmp (`_plain_keras_load.py`).

    Returns:
        Dict: what `_plain_keras_load.py` found (the optimizer, the layers'
        policies, configs and weights, one more training step's loss, ...).
    """
    blocker = tmp_path / "no_tfmp"
    blocker.mkdir(exist_ok=True)
    env = {"PYTHONPATH": without_module(blocker, "tfmp")}
    with started("_plain_keras_load.py", [(["--model", str(path)], env)], tmp_path) as launched:
        (found,) = results(launched, timeout_s=240)
    return found
