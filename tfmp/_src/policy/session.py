"""tfmp's session: what `tfmp.enable()` decided for the calling thread.

Keras keeps its global dtype policy per thread, so sessions are per thread too. A
session is read when a decision is made (a model compiled, loaded, or first called),
never to decide what a step traces for an attached model. The class-level hooks the
sessions need are installed by `tfmp._src.policy.enable` while `any_open`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import keras

from tfmp._src.policy.policy import PolicyDecision


@dataclasses.dataclass
class Session:
    """What `tfmp.enable()` set in one thread (its checked arguments), and what `tfmp.disable()` puts back.

    `previous_policy` is the `keras.DTypePolicy` in force before the first `enable()`;
    `previous_tf32` TensorFlow's process-wide TF32 setting before `enable(tf32=...)`
    changed it, None when left alone; `scoped` True for a `tfmp.policy_scope`'s session.
    """

    decision: PolicyDecision
    previous_policy: keras.DTypePolicy
    previous_tf32: Optional[bool]
    keep_float32: Sequence[Any]
    exclude_float32: Sequence[Any]
    loss_scale_options: dict
    debug: Union[bool, dict] = False
    speedups: Optional[Dict[str, bool]] = None
    verbose: bool = True
    scoped: bool = False


# thread ident -> (the thread, its session). Python reuses the ident of a thread
# that ended, so an entry counts only for the very thread that made it.
_sessions: Dict[int, Tuple[threading.Thread, Session]] = {}
lock = threading.RLock()


def current() -> Optional[Session]:
    """The calling thread's `Session`, or None when tfmp is not enabled in it."""
    entry = _sessions.get(threading.get_ident())
    if entry is None or entry[0] is not threading.current_thread():
        return None
    return entry[1]


def replace(session: Optional[Session]) -> Optional[Session]:
    """Makes `session` the calling thread's (None ends it), forgetting ended threads'; returns the one replaced."""
    with lock:
        alive = set(threading.enumerate())
        for ident in [i for i, (thread, _) in _sessions.items() if thread not in alive]:
            del _sessions[ident]
        before = current()
        if session is None:
            _sessions.pop(threading.get_ident(), None)
        else:
            _sessions[threading.get_ident()] = (threading.current_thread(), session)
        return before


def any_open() -> bool:
    """Bool. Whether some live thread has a session."""
    return bool(open_threads())


def open_threads() -> list:
    """Names of the live threads with a session (for leak reports)."""
    with lock:
        alive = set(threading.enumerate())
        return [thread.name for thread, _ in _sessions.values() if thread in alive]
