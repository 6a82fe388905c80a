"""Model zoo: common architectures train, predict, save and load under tfmp.

Each case (built in ``tests/_zoo.py``) runs under ``tfmp.enable()`` ("auto": the
policy this machine gets) and ``tfmp.enable("mixed_float16")``, through one
helper, `check_model`:

* two training steps with a finite loss;
* ``predict`` returns float32 outputs;
* a ``.keras`` save/load round trip while enabled: the loaded model predicts the
  same and trains one more step with a finite loss;
* ``tfmp.audit`` shows no Dense/Conv layer forced to float32 except the output
  layers.

Six small cases (`FAST`) run in the default suite; the others carry the ``zoo``
marker, deselected by default: ``python -m pytest -q -m zoo tests/test_zoo.py``
runs them (``-m "zoo or not zoo"``: everything).
"""

import configparser
import pathlib
import warnings

import keras
import numpy as np
import pytest
from keras import layers, ops

import tfmp
from _zoo import BATCH, CASES

POLICIES = ["auto", "mixed_float16"]
#: The default suite's subset (about 35 s on 2 cores): the small models under float16
#: with loss scaling ("auto" is float32 on most CPUs).
FAST = {(name, "mixed_float16") for name in (
    "transformer_classifier", "vae_add_loss", "gru", "conv1d_batchnorm", "two_outputs", "custom_train_step")}
#: Layers with large matmuls or convolutions: forcing one to float32 would cost speed.
MATMUL_CLASSES = ("Dense", "EinsumDense", "Conv1D", "Conv2D", "DepthwiseConv2D", "SeparableConv2D")
#: Why such a layer may still be forced: it produces an output, or ends in a softmax.
MATMUL_REASONS = ("output", "fused softmax")


def _resolved(policy: str) -> str:
    return tfmp.recommend_policy().policy if policy == "auto" else policy


def _params():
    for name in CASES:
        for policy in POLICIES:
            marks = [] if (name, policy) in FAST else [pytest.mark.zoo]
            yield pytest.param(name, policy, marks=marks, id=f"{name}-{policy}")


def _float_dtypes(outputs):
    return {np.asarray(x).dtype.name for x in keras.tree.flatten(outputs)}


def _finite_loss(history) -> float:
    losses = history.history["loss"]
    assert all(np.isfinite(losses)), losses
    return losses[-1]


def check_model(name: str, policy: str, path) -> keras.Model:
    """Builds case ``name`` under ``tfmp.enable(policy)`` and runs the common checks."""
    tfmp.enable(policy)
    try:
        case = CASES[name]()
        model = case.model
        model.compile(optimizer="adam", loss=case.loss)
        _finite_loss(model.fit(case.x, case.y, batch_size=BATCH // 2, epochs=1, verbose=0))
        predicted = model.predict(case.x, verbose=0)
        assert _float_dtypes(predicted) == {"float32"}

        model.save(path)
        loaded = keras.saving.load_model(path)
        again = loaded.predict(case.x, verbose=0)
        assert _float_dtypes(again) == {"float32"}
        for after, before in zip(keras.tree.flatten(again), keras.tree.flatten(predicted)):
            np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)
        _finite_loss(loaded.fit(case.x, case.y, batch_size=BATCH, epochs=1, verbose=0))
    finally:
        tfmp.disable()
    rows = tfmp.audit(model, tensor_cores=False).rows
    forced_matmuls = {row.path: row.forced for row in rows
                      if row.class_name in MATMUL_CLASSES and row.forced not in ("",) + MATMUL_REASONS}
    assert forced_matmuls == {}
    assert _forced(loaded) == _forced(model)  # loading while enabled put the forcing back
    return model


def _forced(model):
    """Sorted (class, reason) of the layers tfmp forced (layer names change on loading)."""
    return sorted((r.class_name, r.forced) for r in tfmp.audit(model, tensor_cores=False).rows if r.forced)


@pytest.mark.parametrize("name, policy", list(_params()))
def test_zoo_model(name, policy, tmp_path):
    model = check_model(name, policy, str(tmp_path / f"{name}.keras"))
    assert model.compute_dtype == keras.DTypePolicy(_resolved(policy)).compute_dtype


# -- What the zoo found ------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="tfmp_zoo_tests")
class Residual(layers.Layer):
    """``inner(x) + x`` with a raw ``+``: needs ``inner`` to hand back x's dtype."""

    INNER = {"softmax": layers.Softmax, "unit_norm": layers.UnitNormalization}

    def __init__(self, inner="softmax", **kwargs):
        super().__init__(**kwargs)
        self.kind = inner
        self.inner = self.INNER[inner]()

    def call(self, x):
        return self.inner(x) + x

    def get_config(self):
        return {**super().get_config(), "inner": self.kind}


def _custom_layer_model():
    inputs = keras.Input((4,))
    return keras.Model(inputs, layers.Dense(2)(Residual(name="block")(layers.Dense(4)(inputs))))


def _raw_add_model():
    inputs = keras.Input((4,))
    hidden = layers.Dense(4)(inputs)
    return keras.Model(inputs, layers.Dense(2)(ops.add(layers.Softmax(name="block")(hidden), hidden)))


@pytest.mark.parametrize("build, path", [(_custom_layer_model, "block/{0.inner.name}"), (_raw_add_model, "block")])
def test_forcing_comes_back_when_loaded_while_enabled(build, path, tmp_path):
    # Saving keeps the layers' policies, not tfmp's hooks: a softmax inside custom
    # code came back 16-bit (its parent rebuilds it), one in a functional graph
    # came back float32 handing float32 to the raw add. Loading while enabled
    # applies the rules again.
    x, y = np.ones((4, 4), "float32"), np.zeros((4, 2), "float32")
    tfmp.enable("mixed_float16")
    try:
        model = build()
        model.compile("adam", "mse")
        model.fit(x, y, verbose=0)
        model.save(tmp_path / "model.keras")
        loaded = keras.saving.load_model(tmp_path / "model.keras")
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
        loss = loaded.fit(x, y, verbose=0).history["loss"][0]
    finally:
        tfmp.disable()
    assert np.isfinite(loss)
    rows = {r.path: r for r in tfmp.audit(loaded, tensor_cores=False).rows}
    path = path.format(loaded.get_layer("block"))
    assert (rows[path].compute_dtype, rows[path].forced, rows[path].output_dtype) == ("float32", "softmax", "float16")
    assert rows[loaded.layers[-1].name].forced == "output" and loaded.outputs[0].dtype == "float32"


def test_plain_float32_model_loaded_while_enabled_is_left_as_saved(tmp_path):
    # A Sequential model takes the global policy when loaded, not its saved one: its
    # float32 layers under a float16 model must not be taken for forced ones.
    model = keras.Sequential([keras.Input((4,)), layers.Dense(4), layers.Softmax(), layers.Dense(2)])
    model.save(tmp_path / "plain.keras")
    x = np.random.default_rng(0).normal(size=(4, 4)).astype("float32")
    tfmp.enable("mixed_float16")
    try:
        loaded = keras.saving.load_model(tmp_path / "plain.keras")
    finally:
        tfmp.disable()
    rows = tfmp.audit(loaded, tensor_cores=False).rows
    assert [(r.compute_dtype, r.forced) for r in rows] == [("float32", "")] * 3
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


class SoftmaxHead(keras.Model):
    """Subclassed model whose last layer is a Dense with a fused softmax."""

    def __init__(self):
        super().__init__()
        self.hidden = layers.Dense(16)
        self.head = layers.Dense(64, activation="softmax")
        self.seen = set()

    def call(self, x):
        probs = self.head(self.hidden(x))
        self.seen.add(keras.backend.standardize_dtype(probs.dtype))
        return probs


def test_subclassed_model_returns_its_float32_softmax_unrounded():
    # The head computes in float32 and hands back float16 to the model's code; the
    # model's output is the head's float32 result, not that float16 cast back up.
    keras.config.set_dtype_policy("mixed_float16")
    model = SoftmaxHead()
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    model(x)
    tfmp.force_float32(model)
    eager = keras.ops.convert_to_numpy(model(x))
    traced = model.predict(x, verbose=0)
    assert model.seen == {"float16"}
    assert eager.dtype == traced.dtype == np.float32
    hidden = keras.ops.convert_to_numpy(keras.ops.cast(model.hidden(x), "float32"))
    # The float32 softmax worked out in NumPy.
    logits = hidden @ keras.ops.convert_to_numpy(model.head.kernel) + keras.ops.convert_to_numpy(model.head.bias)
    exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
    expected = exp / exp.sum(axis=-1, keepdims=True)
    for probs in (eager, traced):
        np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-7)
        assert not np.array_equal(probs, probs.astype("float16").astype("float32"))  # not 16-bit values


def test_keras_unit_normalization_overflow_warning_is_gone_once_forced():
    # Keras's ops.normalize caps 1/norm at 1/epsilon = 1e12, converted to the
    # input's dtype: traced in float16 that overflows to inf (numpy warns; the cap
    # is harmless) in Keras 3.12-3.15; keras-nightly 3.16 no longer warns. Keras
    # traces it when the custom layer around it is built, before tfmp; once
    # forced, the layer computes in float32 and no warning comes, whichever Keras.
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    block = Residual("unit_norm", name="block")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)
        model = keras.Model(inputs, layers.Dense(2)(block(inputs)))
    tfmp.force_float32(model)
    model.compile("sgd", "mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        loss = model.train_on_batch(np.ones((2, 4), "float32"), np.zeros((2, 2), "float32"))
    assert np.isfinite(loss) and block.inner.compute_dtype == "float32"


def test_zoo_marker_is_registered_deselected_and_named_in_the_docs():
    root = pathlib.Path(__file__).resolve().parents[1]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    pytest_config = config["tool:pytest"]
    assert '-m "not slow and not zoo"' in pytest_config["addopts"]
    assert any(line.startswith("zoo:") for line in pytest_config["markers"].split("\n"))
    # The command is told where the test tiers are (docs/guides/versions.md).
    assert "`python -m pytest -q -m zoo tests/test_zoo.py`" in (root / "docs" / "guides" / "versions.md").read_text()
    assert sum(1 for name in CASES for policy in POLICIES if (name, policy) not in FAST) == 18
