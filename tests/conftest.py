"""Shared fixtures and the suite's scheduling on pytest-xdist workers.

Every test leaves the Keras global dtype policy as it found it, and leaves no tfmp
state behind (`no_tfmp_state_left`). Under
``-n 2 --dist loadscope`` (README's test command), the modules of
`ONE_WORKER_MODULES` each run on one worker, so their expensive module fixtures
run once; every other test is a unit of its own, so the two workers share them
test by test.
"""

import importlib.util
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

#: Test modules whose module fixtures take tens of seconds: MirroredStrategy
#: subprocesses (distribute), trained models and TFLite files (deployment), policy
#: comparisons (compare), benchmark and side-experiment runs.
ONE_WORKER_MODULES = frozenset({
    "test_benchmarks.py", "test_compare.py", "test_deployment.py", "test_distribute.py",
    "test_side_experiments.py",
})


def scheduling_unit(nodeid):
    """The unit of work a test belongs to: its module's path, or its own node id."""
    module = nodeid.split("::", 1)[0]
    return module if module.rsplit("/", 1)[-1] in ONE_WORKER_MODULES else nodeid


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        """``--dist loadscope`` with `scheduling_unit` as the scope.

        Not ``--dist loadgroup`` with ``xdist_group`` marks: pytest-xdist 3.8 marks a
        group by rewriting node ids, which pytest 9.2 ignores, so every test is
        sent on its own (pytest-xdist issue #1386).
        """
        if config.getvalue("dist") != "loadscope":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class ModuleOrTestScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid):
                return scheduling_unit(nodeid)

        return ModuleOrTestScheduling(config, log)


def tfmp_leftovers():
    """What tfmp still holds outside any model: enabled threads and class-level hooks.

    The stuck check's ``make_train_function`` hook may stay while a
    `tfmp.LossScaleOptimizer` is alive (a module fixture's model holds one).
    """
    from tfmp._src.keras_hooks import patches
    from tfmp._src.loss_scale import loops
    from tfmp._src.policy import enable

    threads = [f"tfmp enabled in {thread.name}" for thread, _ in enable._states.values()]
    allowed = {"loss_scale.fit_check"} if loops._fit_hook is not None else set()
    hooks = [hook for slots in list(patches._CLASS_SLOTS.values()) for slot in slots.values()
             for hook in slot.hooks if hook.owner not in allowed]
    return threads, hooks


@pytest.fixture(autouse=True)
def no_tfmp_state_left():
    """Fails a test that leaves tfmp enabled, a class-level hook on or TF32 changed."""
    import tensorflow as tf

    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    yield
    threads, hooks = tfmp_leftovers()
    leftovers = threads + [repr(hook) for hook in hooks]
    if tf.config.experimental.tensor_float_32_execution_enabled() != tf32:
        leftovers.append(f"TF32 execution left {'on' if not tf32 else 'off'}")
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
    if leftovers:  # cleaned up, so that the tests after this one start clean
        from tfmp._src.policy import enable

        enable._states.clear()
        enable._set_current(None)
        for hook in hooks:
            hook.remove()
        pytest.fail("The test left tfmp state behind: " + "; ".join(leftovers), pytrace=False)


@pytest.fixture(autouse=True)
def restore_global_policy():
    """Restores the Keras global dtype policy (and clears Keras state) after each test."""
    before = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(before)
    keras.backend.clear_session()
