"""A first `fit` that fails while its step is traced leaves the optimizer usable, or says why not."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp

X, Y = np.linspace(0.0, 1.0, 32, dtype="float32").reshape(8, 4), np.ones((8, 2), "float32")


class TwoDense(keras.Model):
    """Subclassed: built by its first step, so Keras builds the optimizer inside that trace."""

    def __init__(self):
        super().__init__()
        self.first, self.second = keras.layers.Dense(3), keras.layers.Dense(2)

    def call(self, x):
        return self.second(self.first(x))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_after_a_first_fit_fails_while_tracing_the_next_fit_trains(policy, kind):
    # float16: a scale at which no step of these unseeded layers can overflow, so a skip means a fault
    options = {"loss_scale_options": {"initial_scale": 256.0}} if policy == "mixed_float16" else {}
    with tfmp.policy_scope(policy, **options):
        model = (TwoDense() if kind == "subclassed" else
                 keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)]))
        model.compile(keras.optimizers.SGD(0.1), "mse")
        with pytest.raises(ValueError, match="Dimensions must be equal"):
            model.fit(X, np.ones((8, 5)), verbose=0)  # the loss fails while the step is traced
        optimizer = model.optimizer
        history = model.fit(X, Y, epochs=3, batch_size=4, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert int(optimizer.iterations.numpy()) == 6 and int(optimizer.total_steps.numpy()) == 6
    assert int(optimizer.overflow_count.numpy()) == 0


class FailsAfterApply(keras.Model):
    """A subclassed model (built at its first step) whose train_step fails once the update is traced."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.fail = True

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        logs = super().train_step(data)
        if self.fail:
            raise RuntimeError("a bug in train_step, after the update")
        return logs


def _fit_after_a_failed_first_fit(model):
    """Fits `model` (compiled, failing), then again once it stops failing."""
    with pytest.raises(RuntimeError, match="a bug in train_step"):
        model.fit(X, Y, verbose=0)
    model.fail, model.train_function = False, None
    return model.fit(X, Y, verbose=0)


def _plain_keras_fits_after_a_failed_first_fit():
    """Whether plain Keras trains an optimizer its failed first trace built (Keras 3.16 does;
    3.12-3.15 fail with a raw TensorFlow error from the stale optimizer state)."""
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = FailsAfterApply()
        model.compile(keras.optimizers.Adam(), "mse")
        _fit_after_a_failed_first_fit(model)
        return True
    except (ValueError, tf.errors.OpError):
        return False
    finally:
        keras.config.set_dtype_policy(before)


def test_an_optimizer_built_in_a_failed_trace_is_named_with_the_fix_not_a_raw_error():
    plain_trains = _plain_keras_fits_after_a_failed_first_fit()
    with tfmp.policy_scope("mixed_float16"):
        model = FailsAfterApply()
        model.compile(keras.optimizers.Adam(), "mse")
        if plain_trains:  # tfmp trains where Keras does
            assert np.isfinite(_fit_after_a_failed_first_fit(model).history["loss"]).all()
            return
        with pytest.raises(ValueError, match=r"Invalid `optimizer` argument\. .* was built inside a first step "
                           r"that failed while tracing, .* Compile the model again with a new optimizer, e\.g\. "
                           r"model\.compile\(keras\.optimizers\.Adam\(\.\.\.\)"):
            _fit_after_a_failed_first_fit(model)
        model.compile(keras.optimizers.Adam(), "mse")  # the fix
        assert np.isfinite(model.fit(X, Y, verbose=0).history["loss"]).all()
