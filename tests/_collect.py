"""A full garbage collection in a suite that freezes what outlives each test (tests/conftest.py)."""

import gc


def collect_everything():
    """Unfreezes the objects earlier tests left, then collects: what is unreachable goes.

    A test that checks an object is gone (its hooks with it) needs this instead of
    `gc.collect()`: an earlier test's model that was still reachable when it was
    frozen, and is not any more, is only collected once unfrozen.
    """
    gc.unfreeze()
    gc.collect()
