"""The output-dtype rule of float32 forcing (tfmp/_src/float32/force.py, registry.py).

A forced layer computes in float32 and hands back the compute dtype of its parent
(the enclosing custom layer, or the model); only layers producing model outputs
return float32. Keras layers that compute in float32 themselves stay 16-bit, and
known-broken Keras layers are forced.
"""

import importlib.util
import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import tfmp
from _zoo import convnext_tiny, transformer_classifier
from tfmp._src.float32 import registry as _registry
from tfmp._src.keras_hooks.versions import keras_at_least

MIXED = ["mixed_bfloat16", "mixed_float16"]


# -- The Keras-examples Transformer text classifier (tests/_zoo.py) ---------------------------


@pytest.mark.parametrize("policy", MIXED)
def test_keras_examples_transformer_trains(policy):
    tfmp.enable(policy)
    try:
        model = transformer_classifier()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        rng = np.random.default_rng(0)
        xs = rng.integers(0, 50, (12, 8)).astype("float32")  # float ids, as in the example
        history = model.fit(xs, rng.integers(0, 2, 12), batch_size=4, epochs=1, verbose=0)
    finally:
        tfmp.disable()
    assert len(history.history["loss"]) == 1 and np.isfinite(history.history["loss"][0])
    assert model.outputs[0].dtype == "float32"
    assert keras.backend.standardize_dtype(model(xs[:2]).dtype) == "float32"
    block = model.layers[2]
    low = policy[6:]
    # LayerNormalization computes in float32 inside Keras: left 16-bit, like plain Keras.
    assert block.layernorm1.compute_dtype == low and block.layernorm2.compute_dtype == low
    assert model.layers[-1].compute_dtype == "float32"  # the output layer
    # Every tensor between input and output has the dtype plain Keras gives it.
    assert [t.dtype for t in (model.layers[1].output, block.output, model.layers[3].output)] == [low] * 3


# -- Residuals and attention inside custom layers ---------------------------------------------


class Residual(layers.Layer):
    """``norm(x) + y`` and ``tf.matmul(softmax(scores), v)`` with raw TensorFlow ops."""

    def __init__(self, norm, **kwargs):
        super().__init__(**kwargs)
        self.proj = layers.Dense(4)
        self.norm = norm
        self.softmax = layers.Softmax()
        self.seen = []

    def call(self, x):
        y = self.proj(x)
        summed = self.norm(x) + y
        probs = self.softmax(tf.matmul(summed, summed, transpose_b=True))
        self.seen.append((keras.backend.standardize_dtype(self.norm(x).dtype),
                          keras.backend.standardize_dtype(probs.dtype)))
        return tf.matmul(probs, y)


@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize(
    "make_norm, keep, norm_forced",
    [(lambda: layers.LayerNormalization(), (), False),  # float32 inside Keras: not forced
     (lambda: layers.UnitNormalization(), (), True),  # 16-bit sums in Keras: forced
     (lambda: layers.LayerNormalization(), (layers.LayerNormalization,), True)],  # user rule
)
def test_residual_and_attention_inside_custom_layers(policy, make_norm, keep, norm_forced):
    keras.config.set_dtype_policy(policy)
    low = policy[6:]
    inputs = keras.Input((3, 4))
    residual = Residual(make_norm(), name="residual")
    model = keras.Model(inputs, layers.Dense(2, name="head")(residual(inputs)))
    tfmp.force_float32(model, keep=keep)
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32")
    model.compile("sgd", "mse")
    loss = model.train_on_batch(x, np.zeros((2, 3, 2), "float32"))
    assert np.isfinite(loss)
    assert residual.norm.compute_dtype == ("float32" if norm_forced else low)
    assert residual.softmax.compute_dtype == "float32"
    assert residual.compute_dtype == low
    assert set(residual.seen) == {(low, low)}  # what the custom code receives
    assert model.outputs[0].dtype == "float32"


class Attend(layers.Layer):
    """Custom layer around a Softmax; records the dtype the softmax hands back."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.softmax = layers.Softmax()
        self.seen = []

    def call(self, scores):
        probs = self.softmax(scores)
        self.seen.append(keras.backend.standardize_dtype(probs.dtype))
        return probs


class Holder(keras.Model):
    def __init__(self):
        super().__init__()
        self.attend = Attend()

    def call(self, x):
        return self.attend(x)


@pytest.mark.parametrize("force", [False, True])
def test_softmax_inside_custom_layer_sums_in_float32_and_returns_float16(force):
    # 2**16 equal logits: summed in float16 the exponentials reach 65536 > 65504
    # (inf) and each probability is 0; in float32 each is 2**-16, exact in float16,
    # and a row sums to exactly 1. Unforced, Keras computes the softmax in float16
    # and the result depends on the CPU's kernel: 0 where it sums in float16, 2**-16
    # where it accumulates wider (seen on AVX512_FP16 CPUs).
    keras.config.set_dtype_policy("mixed_float16")
    model = Holder()
    if force:
        tfmp.force_float32(model)
    probs = keras.ops.convert_to_numpy(keras.ops.cast(model(np.zeros((2, 2**16), "float32")), "float32"))
    assert set(model.attend.seen) == {"float16"}
    if force:
        assert model.attend.softmax.compute_dtype == "float32"
        assert np.unique(probs).tolist() == [2.0**-16]
        np.testing.assert_array_equal(probs.sum(axis=-1), [1.0, 1.0])
    else:
        assert model.attend.softmax.compute_dtype == "float16"
        assert np.unique(probs).tolist() in ([0.0], [2.0**-16])


# -- Keras layers that compute in float32 themselves ------------------------------------------


def float32_inside_layers():
    built = [layers.BatchNormalization(), layers.LayerNormalization(), layers.GroupNormalization(groups=2)]
    if hasattr(layers, "RMSNormalization"):
        built.append(layers.RMSNormalization())
    return built


def test_float32_inside_keras_table_names_the_installed_classes():
    names = {type(layer).__name__ for layer in float32_inside_layers()}
    assert {note.class_path.rsplit(".", 1)[1] for note in _registry.FLOAT32_INSIDE_KERAS} == names
    since = {"GroupNormalization": "3.15"}  # autocast=False from Keras 3.15 on
    for layer in float32_inside_layers():
        version = since.get(type(layer).__name__, "3.12")
        if keras_at_least(version):
            assert _registry.keras_float32_reason(layer) == f"float32 inside Keras >= {version}"
            assert _registry.builtin_reason(layer) is None
        else:  # an older Keras: forced like any normalization layer
            assert _registry.keras_float32_reason(layer) is None
            assert _registry.builtin_reason(layer) == "normalization"

    class Custom(layers.LayerNormalization):
        def call(self, inputs):  # its own call: Keras's upcast is not known to run
            return inputs

    assert _registry.keras_float32_reason(Custom()) is None


@pytest.mark.parametrize("index", range(len(float32_inside_layers())))
def test_keras_normalization_is_finite_on_large_16bit_inputs_without_tfmp(index):
    # Values 60,000-65,000 fit in float16, but their squares and sums do not: a
    # 16-bit mean/variance would be inf. Keras 3.15 computes these in float32.
    keras.config.set_dtype_policy("mixed_float16")
    layer = float32_inside_layers()[index]
    values = np.random.default_rng(0).uniform(60_000, 65_000, (8, 16)).astype("float16")
    assert not np.isfinite(np.sum(np.square(values), dtype=np.float16))
    outputs = layer(values, training=True) if isinstance(layer, layers.BatchNormalization) else layer(values)
    assert keras.backend.standardize_dtype(outputs.dtype) == "float16"
    assert np.isfinite(keras.ops.convert_to_numpy(outputs)).all()


@pytest.mark.parametrize("policy", MIXED)
def test_batch_normalization_stays_16bit_under_tfmp(policy):
    keras.config.set_dtype_policy(policy)
    inputs = keras.Input((4, 4, 3))
    norm = layers.BatchNormalization(name="bn")
    model = keras.Model(inputs, layers.Dense(2)(layers.Flatten()(norm(layers.Conv2D(4, 3)(inputs)))))
    tfmp.force_float32(model)
    assert norm.compute_dtype == policy[6:] and norm.output.dtype == policy[6:]
    assert tfmp.audit(model, tensor_cores=False).warnings == ()


# -- Known-broken Keras layers ----------------------------------------------------------------


def known_broken_class(note):
    module, name = note.class_path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def stochastic_depth_model():
    stochastic_depth = known_broken_class(_registry.KNOWN_BROKEN[0])
    inputs = keras.Input((8,))
    x = layers.Dense(8, name="branch")(inputs)
    x = layers.Add(name="add")([inputs, stochastic_depth(0.5, name="drop_path")(x)])
    return keras.Model(inputs, layers.Dense(2, name="head")(x))


def test_known_broken_classes_exist_in_this_keras():
    """Every Keras class of the table exists; another package's only where that package is installed."""
    keras_notes = [note for note in _registry.KNOWN_BROKEN if note.package == "keras"]
    assert len(keras_notes) >= 4
    for note in _registry.KNOWN_BROKEN:
        if note.package != "keras" and importlib.util.find_spec(note.class_path.split(".")[0]) is None:
            continue
        assert issubclass(known_broken_class(note), keras.layers.Layer), note.class_path
    assert _registry.float32_layers().known_broken == _registry.KNOWN_BROKEN


def test_stochastic_depth_fails_in_plain_keras():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = stochastic_depth_model()
    model.compile("sgd", "mse")
    with pytest.raises(TypeError, match="StochasticDepth"):
        model.fit(np.ones((4, 8), "float32"), np.zeros((4, 2)), batch_size=2, verbose=0)


@pytest.mark.parametrize("policy", MIXED)
def test_stochastic_depth_trains_under_tfmp(policy):
    tfmp.enable(policy)
    try:
        model = stochastic_depth_model()
        model.compile("sgd", "mse")
        history = model.fit(np.ones((4, 8), "float32"), np.zeros((4, 2)), batch_size=2, verbose=0)
    finally:
        tfmp.disable()
    drop = model.get_layer("drop_path")
    assert np.isfinite(history.history["loss"][0])
    assert drop.compute_dtype == "float32" and drop.output.dtype == policy[6:]
    row = {r.path: r for r in tfmp.audit(model, tensor_cores=False).rows}["drop_path"]
    assert row.why == "known fix: float32 random noise times the 16-bit input"


@pytest.mark.slow
def test_convnext_tiny_with_drop_path_trains_under_tfmp():
    tfmp.enable("mixed_bfloat16")
    try:
        model = convnext_tiny(drop_path_rate=0.1, classes=4)
        model.compile("sgd", "sparse_categorical_crossentropy")
        x = np.random.default_rng(0).uniform(0, 255, (2, 32, 32, 3)).astype("float32")
        history = model.fit(x, np.array([0, 1]), batch_size=2, verbose=0)
    finally:
        tfmp.disable()
    assert np.isfinite(history.history["loss"][0]) and model.outputs[0].dtype == "float32"
    forced = {r.why for r in tfmp.audit(model, tensor_cores=False).rows if r.forced}
    assert forced == {"known fix: float32 random noise times the 16-bit input", "output"}
