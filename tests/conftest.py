"""Shared fixtures and the suite's scheduling on pytest-xdist workers.

Every test leaves the Keras global dtype policy as it found it, and leaves no tfmp
state behind (`no_tfmp_state_left`). Under
``-n 2 --dist loadscope`` (README's test command), the modules of
`ONE_WORKER_MODULES` each run on one worker, so their expensive module fixtures
run once; every other test is a unit of its own, so the two workers share them
test by test.
"""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

#: Test modules whose module fixtures take tens of seconds: MirroredStrategy
#: subprocesses (distribute), multi-worker clusters (multi_worker_fit), trained models and TFLite files (deployment), policy
#: comparisons (compare), benchmark and side-experiment runs, the wheel built and
#: installed (packaging).
ONE_WORKER_MODULES = frozenset({
    "test_benchmarks.py", "test_compare.py", "test_deployment.py", "test_distribute.py",
    "test_multi_worker_fit.py", "test_packaging.py", "test_side_experiments.py", "test_softmax_precision.py",
})


#: Modules with tests of 10 s or more (2 idle cores), sent to the workers first, slowest first, so that
#: the run does not end on one of them while the other worker waits. A scheduling hint only: a module
#: missing here runs as fast, just later. xdist's loadscope sends `ONE_WORKER_MODULES` (more tests a
#: unit) before single tests anyway.
SLOW_FIRST = ("test_notebooks.py", "test_examples.py", "test_reproducible.py", "test_monitor.py",
              "test_float16_fusion.py", "test_numerics.py", "test_layer_numerics_3d.py", "test_tfds_preflight.py",
              "test_keras_hooks.py", "test_saved_form.py", "test_startup.py", "test_layer_numerics.py",
              "test_fused_cross_entropy.py", "test_master_weights.py", "test_optional_dependencies.py")


def pytest_collection_modifyitems(session, config, items):
    """Moves the `SLOW_FIRST` modules' tests to the front, module by module (each module's order kept)."""
    rank = {name: index for index, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1], len(rank)))


def pytest_collection_finish(session):
    """Moves what importing TensorFlow, Keras and the test modules made out of the collector's reach.

    Those objects live as long as the process, yet every full `gc.collect()`
    would walk them all again (about 0.4 s on 2 cores). `gc.freeze()` leaves
    them out; see `pytest_runtest_protocol` for what a test makes.
    """
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test (its fixtures gone): collects its garbage, then freezes what is left.

    What is left is what outlives the test: module fixtures and what TensorFlow
    and Keras keep in their caches (a fit keeps about 6,000 objects of its traced
    graphs after `keras.backend.clear_session()`). Frozen, none of it is walked
    again by the next tests' collections; a module's fixtures are unfrozen and
    collected at its end (`no_tfmp_state_at_module_end`). Without this, each
    test's `clear_session()` walked every earlier test's leftovers: two seconds
    a test late in the suite.
    """
    yield
    gc.collect()
    gc.freeze()


def scheduling_unit(nodeid):
    """The unit of work a test belongs to: its module's path, or its own node id."""
    module = nodeid.split("::", 1)[0]
    return module if module.rsplit("/", 1)[-1] in ONE_WORKER_MODULES else nodeid


class ModuleOrTestScheduler:
    """The xdist hook, registered only where pytest-xdist is active (`pytest_configure`):
    under ``-p no:xdist`` pytest refuses a conftest hook of an unknown plugin."""

    @staticmethod
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


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(ModuleOrTestScheduler(), "tfmp-module-or-test-scheduler")


def tfmp_leftovers():
    """What tfmp still holds outside any live model: sessions and class-level hooks.

    The stuck check's ``make_train_function`` hook and the saved form's
    ``get_compile_config`` hook may stay while a `tfmp.LossScaleOptimizer` is alive, and the model-level hooks
    (``Layer.losses``, ``BatchNormalization.call``, the backend's ``gelu``...) while a layer attached at its
    first call is alive (a module fixture's model may hold both); `no_tfmp_state_at_module_end`
    checks that they go with the models.
    """
    from tfmp._src.attachment import hooks as attachment_hooks
    from tfmp._src.attachment import record
    from tfmp._src.keras_hooks import fit_lifecycle
    from tfmp._src.loss_scale import loops
    from tfmp._src.policy import session

    threads = [f"tfmp enabled in {name}" for name in session.open_threads()]
    allowed = {hook.owner for hook in loops._class_hooks}
    if fit_lifecycle._needed_by:
        allowed.add("fit_lifecycle")
    if record.any_attached_at_first_call():
        allowed |= {hook.owner for hook in attachment_hooks.installed()}
    hooks = [hook for hook in _class_hooks() if hook.owner not in allowed]
    return threads, hooks


def _class_hooks():
    """The hooks on Keras's classes and on the backend modules whose ``gelu``, ``add`` and ``dropout`` tfmp hooks."""
    from tfmp._src.keras_hooks import surfaces

    return surfaces.process_wide()


def _clean_up(hooks):
    from tfmp._src.policy import enable, session

    session._sessions.clear()
    enable._set_current(None)
    for hook in hooks:
        hook.remove()


@pytest.fixture(autouse=True)
def no_tfmp_state_left():
    """Fails a test that leaves tfmp enabled, a class-level hook on, injected device facts or TF32 changed."""
    import tensorflow as tf

    from tfmp._src.policy import enable

    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    yield
    gc.collect()  # the test's models are gone (cheap: earlier tests' leftovers are frozen)
    enable._release_unused_hooks()  # as tfmp.disable() does: the hooks no live model needs
    threads, hooks = tfmp_leftovers()
    leftovers = threads + [repr(hook) for hook in hooks]
    from tfmp._src.policy import hardware

    if hardware._injected:  # a machine's facts injected and not taken off
        leftovers.append(f"injected device facts left: {hardware._injected}")
        hardware._injected.clear()
    if tf.config.experimental.tensor_float_32_execution_enabled() != tf32:
        leftovers.append(f"TF32 execution left {'on' if not tf32 else 'off'}")
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
    if leftovers:  # cleaned up, so that the tests after this one start clean
        _clean_up(hooks)
        pytest.fail("The test left tfmp state behind: " + "; ".join(leftovers), pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def no_tfmp_state_at_module_end():
    """Once a module's models are gone: no attached object alive, no class-level hook on.

    Checks that no tfmp registry keeps a model (and so its hooks) alive.
    """
    yield
    from tfmp._src.attachment import hooks as attachment_hooks
    from tfmp._src.attachment import record
    from tfmp._src.policy import enable

    gc.unfreeze()  # the module's fixtures, frozen after each of its tests
    keras.backend.clear_session()  # its gc.collect() walks every object of the process: once (frozen below)
    enable.disable()  # not enabled here: takes off the hooks no live model needs
    hooks = _class_hooks()
    leftovers = [repr(hook) for hook in hooks]
    if record.any_marked():
        leftovers.append(f"{len(record._marked)} attached objects alive")
    if leftovers:
        record.unmark(list(record._marked))
        _clean_up(hooks + attachment_hooks.installed())
        pytest.fail("The module left tfmp state behind: " + "; ".join(leftovers), pytrace=False)
    # What is left outlives the module: frozen now, so that the collection after this
    # test (`pytest_runtest_protocol`) does not walk it all a second time (a second or
    # two late in the suite, at every module switch of an xdist worker). Hooks
    # `disable` just dropped are collected at the next module's end.
    gc.freeze()


@pytest.fixture(autouse=True)
def restore_global_policy():
    """Restores the Keras global dtype policy (and clears Keras state) after each test."""
    before = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(before)
    keras.backend.clear_session(free_memory=False)  # collected by no_tfmp_state_left


@pytest.fixture
def restore_probe_caches():
    """Leaves the process's bias-gradient known-answer checks as each test found them
    (for the modules that clear them or check with a replaced `measure`; not autouse:
    restoring an empty cache after every test would check again in the next)."""
    from tfmp._src.float32 import bias_gradient

    before = dict(bias_gradient._cache)
    yield
    bias_gradient._cache.clear()
    bias_gradient._cache.update(before)


# The XLA tier (tests/_xla.py): with TFMP_TEST_JIT_COMPILE=1, every compile whose
# jit_compile is "auto" (Keras's default) uses XLA as on a GPU, for the whole
# session (module fixtures included); Keras's own resolution is back at the end.
@pytest.fixture(autouse=True, scope="session")
def xla_tier_auto_jit_compile():
    """Under ``TFMP_TEST_JIT_COMPILE=1``: ``jit_compile="auto"`` resolves as on a GPU (`_xla.gpu_like_auto_jit_compile`)."""
    import _xla

    if not _xla.xla_tier():
        yield
        return
    with _xla.gpu_like_auto_jit_compile():
        yield
