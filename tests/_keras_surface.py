"""Prints, as JSON, every method and property Keras's main classes define.

Run as a script: ``python tests/_keras_surface.py``. It reads the surface
before tfmp is imported (``"plain"``), then enables tfmp, trains a model under a
loss-scale optimizer, with a monitor, check_numerics and an audit, saves and loads
it, lets every tfmp object go (garbage collection, then `tfmp.disable()`: the stuck
check's hook comes off there or at the next ``make_train_function``, not from the
garbage collector) and reads it again (``"after"``).
`tests/test_keras_hooks.py` compares the two: after tfmp lets go, Keras is as an
import without tfmp made it.
"""

import gc
import inspect
import json
import sys
import tempfile

import keras
import numpy as np

CLASSES = [keras.Model, keras.layers.Layer, keras.layers.BatchNormalization,
           keras.layers.Dense, keras.layers.Embedding, keras.optimizers.Optimizer,
           keras.optimizers.LossScaleOptimizer, keras.DTypePolicy]


def describe(value):
    """Where a class attribute's code lives (identity cannot cross processes)."""
    function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    code = getattr(function, "__code__", None)
    where = (code.co_filename, code.co_firstlineno) if code else None
    return [type(value).__name__, getattr(function, "__qualname__", None), where]


def surface():
    found = {}
    for cls in CLASSES:
        for klass in inspect.getmro(cls):
            if klass.__module__.split(".")[0] not in ("keras", "tensorflow"):
                continue
            for name, value in vars(klass).items():
                if callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                    found[f"{klass.__module__}.{klass.__qualname__}.{name}"] = describe(value)
    return found


def train_under_tfmp(logdir):
    import tfmp

    tfmp.enable("mixed_float16")
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8)(inputs)
    x = keras.layers.BatchNormalization()(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile("adam", "mse")
    tfmp.check_numerics(model)
    data = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    model.fit(*data, epochs=1, verbose=0,
              callbacks=[tfmp.LossScaleMonitor(logdir, grad_stats_freq=1)])
    tfmp.audit(model, batch=data[0][:2])
    model.save(f"{logdir}/model.keras")
    keras.models.load_model(f"{logdir}/model.keras")  # attached while loading


def use_tfmp():
    import tfmp

    with tempfile.TemporaryDirectory() as logdir:
        train_under_tfmp(logdir)  # its model goes with its frame
    keras.backend.clear_session()
    gc.collect()
    tfmp.disable()


if __name__ == "__main__":
    assert "tfmp" not in sys.modules
    plain = surface()
    use_tfmp()
    print(json.dumps({"plain": plain, "after": surface()}))
