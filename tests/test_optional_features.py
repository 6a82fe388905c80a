"""Every optional feature whose Keras surface fails to install is off alone, with one warning.

"Keras moved it" is simulated where tfmp handles it: the feature's installer
raises AttributeError (its table entry replaced), or, for the fused optimizer
update, the slot accessor it reads does. `enable`, `compile`, `fit`, `save` and
`load` go on as under plain Keras for that part.
"""

import warnings

import keras
import numpy as np
import pytest
from _collect import collect_until

import tfmp
from tfmp._src.attachment import hooks as attachment_hooks
from tfmp._src.keras_hooks import availability
from tfmp._src.policy import fused_update
from tfmp._src.policy import enable as enable_module

X = np.linspace(-1.0, 1.0, 64, dtype="float32").reshape(16, 4)
Y = np.linspace(0.0, 1.0, 32, dtype="float32").reshape(16, 2)
#: Feature -> the table tfmp installs it from.
TABLES = {feature: (attachment_hooks, "OPTIONAL") for feature, _ in attachment_hooks.OPTIONAL}
TABLES.update({feature: (enable_module, "_OPTIONAL_SESSION_HOOKS")
               for feature, _ in enable_module._OPTIONAL_SESSION_HOOKS})


def _moved(feature):
    def install():
        raise AttributeError(f"module 'keras.src' has no attribute '{feature}_surface'")

    return install


def _train_save_load(tmp_path):
    tfmp.enable("mixed_bfloat16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="gelu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    model.compile("adam", "mse")
    losses = model.fit(X, Y, batch_size=4, epochs=2, verbose=0).history["loss"]
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    return model, losses, loaded


def _no_hooks_left():
    tfmp.disable()
    return attachment_hooks.installed() == []


@pytest.mark.parametrize("feature", sorted(set(TABLES) | {"fused_update"}))
def test_a_feature_that_cannot_install_is_off_alone_and_training_saving_loading_go_on(
        feature, monkeypatch, tmp_path):
    collect_until(_no_hooks_left)
    assert attachment_hooks.installed() == []  # installed afresh by this test's enable()
    if feature == "fused_update":
        def moved(optimizer, variable):
            raise AttributeError("'Adam' object has no attribute '_momentums'")

        monkeypatch.setattr(fused_update, "adam_slots", moved)
    else:
        module, name = TABLES[feature]
        monkeypatch.setattr(module, name, tuple(
            (entry, _moved(entry) if entry == feature else install) for entry, install in getattr(module, name)))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, losses, loaded = _train_save_load(tmp_path)
        said = [str(w.message) for w in caught if "turned one feature off" in str(w.message)]
        assert len(said) == 1, said
        assert said[0].startswith(f"tfmp turned one feature off in this process: {availability.FEATURES[feature]}.\n")
        assert f"Keras {keras.__version__}" in said[0] and "AttributeError" in said[0]
        assert availability.off(feature) and all(availability.off(other) is None
                                                 for other in availability.FEATURES if other != feature)
        assert np.isfinite(losses).all() and int(model.optimizer.iterations.numpy()) == 8  # 2 epochs of 4 steps
        np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0), rtol=1e-2, atol=1e-2)
        again = keras.models.clone_model(model)  # attached after the feature went off
        again.compile("adam", "mse")
        speedups = tfmp.attachment(again).speedups
        if feature in speedups:  # a speed feature: the attachment says why it is off
            assert speedups[feature].startswith("off") and "AttributeError" in speedups[feature]
        del model, loaded, again
    finally:
        tfmp.disable()
        availability.clear()
