"""Shared fixtures: every test leaves the Keras global dtype policy as it found it."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def restore_global_policy():
    """Restores the Keras global dtype policy (and clears Keras state) after each test."""
    before = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(before)
    keras.backend.clear_session()
