"""A full garbage collection in a suite that freezes what outlives each test (tests/conftest.py)."""

import gc
from typing import Callable


def collect_everything():
    """Unfreezes the objects earlier tests left, then collects: what is unreachable goes.

    A test that checks an object is gone (its hooks with it) needs this instead of
    `gc.collect()`: an earlier test's model that was still reachable when it was
    frozen, and is not any more, is only collected once unfrozen.
    """
    gc.unfreeze()
    gc.collect()


def collect_until(done: Callable[[], bool]) -> None:
    """`gc.collect()`, then `collect_everything` only where ``done()`` is still False.

    A full collection walks every object earlier tests left (seconds late in the
    suite); most tests leave nothing frozen that holds what ``done`` waits for.
    """
    gc.collect()
    if not done():
        collect_everything()
