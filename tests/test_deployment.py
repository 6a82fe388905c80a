"""tfmp.to_float32 and tfmp.export: float32 copies, TFLite and SavedModel artifacts.

Models are trained a few steps under tfmp.enable("mixed_bfloat16") and
"mixed_float16" (on a CPU without bfloat16/float16 arithmetic both are emulated,
slowly but correctly). TFLite conversion takes seconds, so trained models and
converted artifacts are module fixtures shared by the tests.

Tolerances. `max_rel_diff` is an output's largest absolute difference over the
largest magnitude of the trained output. The trained model rounds to its compute
dtype after each op: unit roundoff 2**-9 for bfloat16 (8 significant bits) and
2**-11 for float16 (11 bits); these models chain about 8 rounded ops from input to
output (cast, conv or matmul, bias, activation, normalization, dense, attention),
so the bounds are 8 roundings: 2**-6 (bfloat16) and 2**-8 (float16). They are a
typical error, not a worst case: cancellation in a dot product can exceed them for
some initial weights (over 40 initial seeds, the largest error of the untrained
to_float32 models was 2**-5.7 for bfloat16 and 2**-8.5 for float16, against medians
of 2**-7.7 to 2**-6.7 and about 2**-10.7), so every model here is built from a fixed
seed. The artifact against the float32 copy is float32 against float32 (kernels
differ only in summation order): 1e-5.
"""

import json
import pathlib
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.deployment.export import SAMPLE_BATCH, tflite_interpreter
from tfmp._src.keras_hooks.export_io import tflite_converter_error
from tfmp._src.layer_tree import walk

POLICIES = ("mixed_bfloat16", "mixed_float16")
TOLERANCE = {"mixed_bfloat16": 2.0**-6, "mixed_float16": 2.0**-8}
FLOAT32_TOLERANCE = 1e-5
ROOT = pathlib.Path(__file__).resolve().parents[1]

# One worker runs this module (conftest.ONE_WORKER_MODULES), so its module fixtures run once.
pytestmark = [pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")]


# -- models --------------------------------------------------------------------


def build_cnn():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    x = keras.layers.Dense(10)(x)
    return keras.Model(inputs, keras.layers.Softmax()(x), name="cnn")


def build_transformer():
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(32, 16)(tokens)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    hidden = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(16)(hidden))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(2, activation="softmax")(x), name="transformer")


def data(kind, rows=64, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "cnn":
        return rng.random((rows, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, rows)
    return rng.integers(0, 32, (rows, 8)).astype("int32"), rng.integers(0, 2, rows)


def train(kind, policy, steps=4):
    """A model built, compiled and trained `steps` batches under tfmp.enable(policy)."""
    keras.utils.set_random_seed(0)
    x, y = data(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        with tfmp.policy_scope(policy):
            model = build_cnn() if kind == "cnn" else build_transformer()
            # Eager steps: tracing the train step costs ~10 s here, and what these
            # tests need is a model trained under the policy, not a fast loop.
            model.compile("adam", "sparse_categorical_crossentropy", run_eagerly=True)
            model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=steps, verbose=0)
    return model


@pytest.fixture(scope="module")
def trained():
    """{(kind, policy): model}, built lazily once per module.

    The models are let go at the module's end: the module's last test still holds
    `get` while the module-end check (conftest.py) looks for live attached models.
    """
    cache = {}

    def get(kind, policy):
        if (kind, policy) not in cache:
            cache[kind, policy] = train(kind, policy)
        return cache[kind, policy]

    yield get
    cache.clear()


def sample(kind):
    return data(kind, rows=16, seed=1)[0]


def outputs(model, x):
    return np.asarray(model(x, training=False)).astype(np.float32)


def snapshot(model):
    """Values and policies of every variable and layer, to prove nothing changed."""
    return (
        [np.array(v) for v in model.get_weights()],
        [(e.path, e.layer.dtype_policy.name) for e in walk(model)],
        [v.dtype for v in model.weights],
    )


def assert_unchanged(before, after):
    assert len(before[0]) == len(after[0])
    for old, new in zip(before[0], after[0]):
        np.testing.assert_array_equal(old, new)
    assert before[1:] == after[1:]


def rel_diff(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# -- to_float32 ----------------------------------------------------------------


def build_sequential():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
         keras.layers.LayerNormalization(), keras.layers.Dense(3)], name="seq")


def build_nested():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization()],
                             name="inner")
    inputs = keras.Input((4,))
    block_in = keras.Input((8,))
    block = keras.Model(block_in, keras.layers.Dense(8, activation="relu")(block_in), name="block")
    return keras.Model(inputs, keras.layers.Dense(3)(block(inner(inputs))), name="nested")


@keras.saving.register_keras_serializable("tfmp_tests")
class Residual(keras.Model):
    """A subclassed model with get_config."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(x + self.dense(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class Wrapped(keras.Model):
    """A subclassed model without get_config: its argument is a layer object."""

    def __init__(self, layer):
        super().__init__()
        self.inner = layer

    def call(self, x):
        return self.inner(x)


def build_subclassed():
    model = Residual(units=4, name="residual")
    model(np.zeros((2, 4), "float32"))
    return model


INPUT_SHAPES = {"functional": (8, 8, 1)}
BUILDERS = {"sequential": build_sequential, "functional": build_cnn, "nested": build_nested,
            "subclassed": build_subclassed}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", BUILDERS)
def test_to_float32_copies_every_layer_and_weight(kind, policy):
    keras.utils.set_random_seed(0)  # the bounds hold for typical weights, not for every draw
    with tfmp.policy_scope(policy):
        model = BUILDERS[kind]()
        model.compile("adam", "mse")
    x = np.random.default_rng(0).random((3,) + INPUT_SHAPES.get(kind, (4,)), dtype=np.float32)
    before = snapshot(model)
    trained_out = outputs(model, x)
    copy = tfmp.to_float32(model)
    assert_unchanged(before, snapshot(model))
    assert type(copy) is type(model) and copy is not model
    assert not copy.compiled  # no training optimizer (tfmp's would need tfmp to load)
    assert {e.layer.dtype_policy.name for e in walk(copy)} | {copy.dtype_policy.name} == {"float32"}
    if kind == "subclassed":  # sublayers made in __init__ take fresh automatic names
        assert [type(e.layer) for e in walk(copy)] == [type(e.layer) for e in walk(model)]
    else:
        assert [e.path for e in walk(copy)] == [e.path for e in walk(model)]
    assert len(copy.weights) == len(model.weights) > 0
    for old, new in zip(model.weights, copy.weights):
        assert new.dtype == "float32" and old.path.split("/")[-1] == new.path.split("/")[-1]
        np.testing.assert_array_equal(new.numpy(), old.numpy())  # float32 masters: exact
    assert {str(w.dtype) for w in copy.get_weights()} == {"float32"}
    got = outputs(copy, x)
    assert rel_diff(got, trained_out) <= TOLERANCE[policy]
    # The copy computes in float32: a 16-bit model gives other numbers.
    assert not np.array_equal(got, trained_out)


def test_to_float32_casts_16_bit_variables():
    """A pure-16-bit model (variables bfloat16) gets float32 variables of equal value."""
    keras.config.set_dtype_policy("bfloat16")  # conftest restores the global policy
    model = build_sequential()
    assert {v.dtype for v in model.weights} == {"bfloat16"}
    copy = tfmp.to_float32(model)
    assert {v.dtype for v in copy.weights} == {"float32"}
    for old, new in zip(model.weights, copy.weights):
        np.testing.assert_array_equal(old.numpy().astype(np.float32), new.numpy())


def test_to_float32_without_get_config_says_what_to_implement():
    with tfmp.policy_scope("mixed_bfloat16"):
        model = Wrapped(keras.layers.Dense(2))
        model(np.zeros((2, 4), "float32"))
        inputs = keras.Input((4,))
        functional = keras.Model(inputs, Wrapped(keras.layers.Dense(2))(inputs))
    before = snapshot(model)
    for case in (model, functional):
        with pytest.raises(ValueError, match=r"Invalid `model` argument.*rebuilding Wrapped failed.*"
                           r"Implement `get_config\(\)` in Wrapped") as info:
            tfmp.to_float32(case)
        assert isinstance(info.value.__cause__, NotImplementedError)
    assert_unchanged(before, snapshot(model))


@pytest.mark.parametrize("bad, message", [
    ("model.keras", r"Expected a built `keras.Model`. Received: model='model.keras'"),
    (keras.Sequential([keras.layers.Dense(2)]), r"Build it first"),
])
def test_to_float32_rejects_what_is_not_a_built_model(bad, message):
    with pytest.raises(ValueError, match=message):
        tfmp.to_float32(bad)


# -- export: TFLite ------------------------------------------------------------


@pytest.fixture(scope="module")
def tflite(trained, tmp_path_factory):
    """{(kind, policy, weights): (path, report)}, converted lazily once per module."""
    cache = {}

    def get(kind, policy, weights="float32"):
        key = (kind, policy, weights)
        if key not in cache:
            path = tmp_path_factory.mktemp("tflite") / f"{kind}_{policy}_{weights}.tflite"
            report = tfmp.export(trained(kind, policy), path, format="tflite", weights=weights,
                                 sample=sample(kind))
            cache[key] = (path, report)
        return cache[key]

    return get


def run_tflite(path, x):
    """The file through tf.lite.Interpreter, independently of tfmp.export's run."""
    interpreter = tflite_interpreter(str(path))
    runner = interpreter.get_signature_runner("serving_default")
    (name,) = interpreter.get_signature_list()["serving_default"]["inputs"]
    (out,) = runner(**{name: x}).values()
    return np.array(out)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_tflite_matches_trained_model(trained, tflite, kind, policy):
    model = trained(kind, policy)
    before = snapshot(model)
    path, report = tflite(kind, policy)
    assert_unchanged(before, snapshot(model))
    x = sample(kind)
    got = run_tflite(path, x)
    want = outputs(model, x)
    assert got.dtype == np.float32 and got.shape == want.shape == (16, 2 if kind == "transformer" else 10)
    # The report tells the truth about the file.
    assert report.max_abs_diff == pytest.approx(float(np.max(np.abs(got - want))), rel=1e-6)
    assert report.max_rel_diff == pytest.approx(rel_diff(got, want), rel=1e-6)
    assert 0 < report.max_rel_diff <= TOLERANCE[policy]
    assert (report.format, report.weights, report.output_shapes, report.output_dtypes) == (
        "tflite", "float32", (want.shape,), ("float32",))
    assert report.size_bytes == path.stat().st_size and report.sample_rows == 16
    # The file holds the float32 copy: float32 against float32.
    np.testing.assert_allclose(got, outputs(tfmp.to_float32(model), x), atol=FLOAT32_TOLERANCE)


def test_float16_weights_smaller_file_bounded_difference(tflite):
    path32, _ = tflite("cnn", "mixed_bfloat16")
    path16, report16 = tflite("cnn", "mixed_bfloat16", "float16")
    assert report16.weights == "float16"
    assert path16.stat().st_size < 0.75 * path32.stat().st_size
    x = sample("cnn")
    out32, out16 = run_tflite(path32, x), run_tflite(path16, x)
    # Each weight rounded to 11 significant bits (2**-11 relative); bounded like
    # float16 compute: 2**-8 of the output's magnitude.
    assert 0 < rel_diff(out16, out32) <= 2.0**-8
    assert report16.max_rel_diff <= TOLERANCE["mixed_bfloat16"] + 2.0**-8


class Inverse(keras.layers.Layer):
    """Uses tf.linalg.inv (MatrixInverse), which TFLite's builtin ops lack."""

    def call(self, x):
        return tf.linalg.inv(tf.reshape(x, (-1, 2, 2)) + tf.eye(2, dtype=x.dtype) * 3.0)


def test_unconvertible_op_names_op_and_layer(tmp_path):
    with tfmp.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        x = Inverse(name="inverse")(keras.layers.Dense(4)(inputs))
        model = keras.Model(inputs, keras.layers.Flatten()(x))
    with pytest.raises(ValueError, match=r"TFLite cannot convert the float32 copy of model .* at "
                       r"layer 'inverse' \(TensorFlow ops MatrixInverse\).*SELECT_TF_OPS") as info:
        tfmp.export(model, tmp_path / "m.tflite", format="tflite")
    assert isinstance(info.value.__cause__, tflite_converter_error())


# -- export: SavedModel --------------------------------------------------------


@pytest.mark.parametrize("kind, policy", [("cnn", "mixed_bfloat16"), ("transformer", "mixed_float16")])
def test_saved_model_serving_signature(trained, tmp_path, kind, policy):
    model = trained(kind, policy)
    report = tfmp.export(model, tmp_path / "sm", sample=None)  # sample from the signature
    assert report.sample_rows == SAMPLE_BATCH and report.format == "tf_saved_model"
    assert 0 < report.max_rel_diff <= TOLERANCE[policy]
    assert report.size_bytes > 0 and str(report).startswith("tfmp export: tf_saved_model")
    serving = tf.saved_model.load(str(tmp_path / "sm")).signatures["serving_default"]
    (name, spec), = serving.structured_input_signature[1].items()
    assert spec.dtype == (tf.float32 if kind == "cnn" else tf.int32)
    x = sample(kind)
    (got,) = [np.array(v) for v in serving(**{name: tf.constant(x)}).values()]
    assert rel_diff(got, outputs(model, x)) <= TOLERANCE[policy]
    np.testing.assert_allclose(got, outputs(tfmp.to_float32(model), x), atol=FLOAT32_TOLERANCE)


@pytest.mark.parametrize("kwargs, message", [
    ({"format": "tflight"}, r"Invalid `format` argument.*Received: format='tflight'.*Did you mean 'tflite'\?"),
    ({"format": "onnx"}, r"Expected one of 'tf_saved_model', 'tflite'. Received: format='onnx'"),
    ({"weights": "fp16", "format": "tflite"}, r"Received: weights='fp16'.*Did you mean 'float16'\?"),
    ({"weights": "float16"}, r"Float16 weight quantization is a TFLite option"),
    ({"sample": [np.zeros((2, 8, 8, 1)), np.zeros((2, 8, 8, 1))]}, r"Expected 1 input array"),
])
def test_export_argument_errors(trained, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfmp.export(trained("cnn", "mixed_bfloat16"), tmp_path / "out", **kwargs)


# -- .keras without tfmp -------------------------------------------------------

LOADER = """
import json, sys
import numpy as np
import keras
folder = sys.argv[1]
x = np.load(folder + "/x.npy")
result = {}
for name in ("float32", "mixed"):
    model = keras.models.load_model(f"{folder}/{name}.keras", compile=False)
    result[name] = {
        "prediction": np.asarray(model(x, training=False)).astype("float32").tolist(),
        "compute_dtypes": sorted({layer.compute_dtype for layer in model.layers}),
    }
result["tfmp_imported"] = any(m == "tfmp" or m.startswith("tfmp.") for m in sys.modules)
with open(folder + "/result.json", "w") as file:
    json.dump(result, file)
"""


def test_keras_file_loads_for_float32_inference_without_tfmp(trained, tmp_path):
    model = trained("cnn", "mixed_bfloat16")  # compiled with tfmp.LossScaleOptimizer
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
    tfmp.to_float32(model).save(tmp_path / "float32.keras")
    model.save(tmp_path / "mixed.keras")
    x = sample("cnn")
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    subprocess.run([sys.executable, "-c", LOADER, str(tmp_path)], cwd=str(tmp_path), env=env,
                   check=True, timeout=120, capture_output=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["tfmp_imported"] is False
    assert result["float32"]["compute_dtypes"] == ["float32"]
    got = np.asarray(result["float32"]["prediction"], np.float32)
    assert 0 < rel_diff(got, outputs(model, x)) <= TOLERANCE["mixed_bfloat16"]
    np.testing.assert_allclose(got, outputs(tfmp.to_float32(model), x), atol=FLOAT32_TOLERANCE)
    # The trained model's own file also loads without tfmp (compile=False), but
    # keeps computing in bfloat16: what the float32 copy is for.
    assert "bfloat16" in result["mixed"]["compute_dtypes"]
    np.testing.assert_allclose(result["mixed"]["prediction"], outputs(model, x), atol=1e-6)
