"""The XLA tier: the suite with every ``jit_compile="auto"`` compiled as on a GPU.

Keras resolves ``model.compile(jit_compile="auto")`` (its default) to XLA
wherever an accelerator is present and to a plain ``tf.function`` graph on a
CPU-only machine, so a suite run on CPUs never trains the way a GPU user's
model does. With ``TFMP_TEST_JIT_COMPILE=1`` in the environment,
`gpu_like_auto_jit_compile` (installed for the whole session by
``tests/conftest.py``) resolves "auto" as Keras does on a GPU: ``True`` unless
the model trains under a tf.distribute strategy or holds a layer that does not
support XLA. An explicit ``jit_compile=True`` or ``False`` is kept.

A test whose premise is the graph without XLA (it counts that graph's ops,
reads a kernel only that path runs, or makes XLA fail on purpose) is marked
``@not_under_xla("the premise")``: skipped in this tier, naming the premise.
"""

import contextlib
import os

import numpy as np
import pytest

#: The environment variable that turns the tier on ("1").
VARIABLE = "TFMP_TEST_JIT_COMPILE"


def xla_tier() -> bool:
    """Bool. True when this run is the XLA tier (``TFMP_TEST_JIT_COMPILE=1``).

    Raises:
        ValueError: when the variable is set to anything but "", "0" or "1", so
            that a typo does not run the plain tier while claiming the XLA one.
    """
    value = os.environ.get(VARIABLE, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{VARIABLE}={value!r}: set it to 1 (the XLA tier) or 0 / unset (the plain tier).")
    return value == "1"


def not_under_xla(premise: str):
    """A mark skipping a test in the XLA tier, for a premise only the graph without XLA keeps.

    Args:
        premise: String, what the test reads or counts that XLA compiles away.

    Returns:
        A ``pytest.mark.skipif`` mark whose reason names the tier and `premise`.
    """
    return pytest.mark.skipif(xla_tier(), reason=f"XLA tier ({VARIABLE}=1): {premise}")


def _gpu_like_resolution(model) -> bool:
    """Keras's ``Trainer._resolve_auto_jit_compile`` on a machine with a GPU."""
    from keras.src.trainers import trainer

    if getattr(model, "_distribute_strategy", None):
        return False  # Keras: "Disable XLA with tf.distribute"
    return bool(trainer.model_supports_jit(model))


def base_trainer() -> type:
    """Keras's base trainer class, which defines ``_resolve_auto_jit_compile``: ``Trainer``
    in Keras 3.12-3.15, ``BaseTrainer`` from 3.16 (`trainer.BASE_TRAINER_NAMES`).

    Raises:
        AttributeError: when no such class defines the method (Keras moved it).
    """
    from keras.src.trainers import trainer

    from tfmp._src.keras_hooks.trainer import BASE_TRAINER_NAMES

    for name in BASE_TRAINER_NAMES:
        if "_resolve_auto_jit_compile" in vars(getattr(trainer, name, object)):
            return getattr(trainer, name)
    raise AttributeError(
        f"{VARIABLE}=1: this Keras has no {' or '.join(BASE_TRAINER_NAMES)}._resolve_auto_jit_compile, "
        "so the XLA tier cannot resolve jit_compile='auto' as on a GPU; update tests/_xla.py for it.")


@contextlib.contextmanager
def gpu_like_auto_jit_compile():
    """Resolves ``jit_compile="auto"`` as Keras does on a GPU while the block runs.

    Replaces ``_resolve_auto_jit_compile`` of Keras's base trainer (``keras.src.trainers.trainer``)
    (which ``compile(jit_compile="auto")`` and an uncompiled model's
    ``jit_compile`` call) and puts Keras's own back on exit, also on errors.

    Raises:
        AttributeError: when this Keras has no such method: the tier cannot
            force XLA there, and says so rather than run the plain tier.
    """
    base = base_trainer()
    original = vars(base)["_resolve_auto_jit_compile"]
    base._resolve_auto_jit_compile = _gpu_like_resolution
    try:
        yield
    finally:
        base._resolve_auto_jit_compile = original


def assert_same_step_results(plain_losses, plain_weights, hooked_losses, hooked_weights):
    """Asserts a checked run's losses and weights are a plain run's: bitwise without XLA, within 1e-5 under XLA.

    Args:
        plain_losses, hooked_losses: Lists of floats, the losses per step or epoch.
        plain_weights, hooked_weights: Lists of NumPy arrays, the weights after.

    Raises:
        AssertionError: when they differ (bitwise; under XLA beyond rounding).

    XLA fuses the step anew around the checks' reductions and may sum the loss
    and the gradients in another order: the checked run differs by float32
    rounding (1 ulp of the first loss here), never by more.
    """
    if not xla_tier():
        assert plain_losses == hooked_losses
        assert all(np.array_equal(a, b) for a, b in zip(plain_weights, hooked_weights))
        return
    np.testing.assert_allclose(hooked_losses, plain_losses, rtol=1e-5)
    for a, b in zip(plain_weights, hooked_weights):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
