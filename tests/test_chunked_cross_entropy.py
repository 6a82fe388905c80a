"""The chunked cross-entropies (tfmp/_src/float32/chunked_cross_entropy.py, chunked_losses.py) against
Keras's own float32 losses on the same logits cast to float32; a model trained with one under tfmp.

Expected values come from Keras: ``keras.losses.SparseCategoricalCrossentropy(from_logits=True)``
(and ``CategoricalCrossentropy`` for label smoothing and dense labels) on float32 logits, and
their gradients by ``tf.GradientTape``.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import _xla
import tfmp
from tfmp._src.float32 import chunked_cross_entropy
from tfmp._src.float32.logits import LOGITS_16BIT

#: Machine epsilon of each 16-bit dtype: a gradient rounded once from float32 is within it (relative).
EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
CLASSES = 40
#: Three rows per chunk: 10 or 12 rows make several chunks, the last one taking rows again from the end.
CHUNK = 3 * CLASSES * 4


def _keras_loss_and_grad(loss, y, logits, sample_weight):
    x = tf.cast(logits, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss(y, x, sample_weight=sample_weight)
    return value, tape.gradient(value, x)


def _ours(loss, y, logits, sample_weight):
    with tf.GradientTape() as tape:
        tape.watch(logits)
        value = loss(y, logits, sample_weight=sample_weight)
    return value, tape.gradient(value, logits)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_loss_and_gradient_equal_kerass_float32_loss(dtype):
    rng = np.random.default_rng(7)
    for shape in [(10,), (3, 4)]:
        logits = tf.cast(rng.normal(size=shape + (CLASSES,)) * 4, dtype)
        ids = rng.integers(1, CLASSES, size=shape)
        ids.flat[::3] = 0  # the ignored class
        weight = rng.uniform(0.5, 2.0, size=shape[:1] + (1,) * (len(shape) - 1)).astype("float32")
        one_hot = tf.one_hot(ids, CLASSES)
        probabilities = tf.nn.softmax(rng.normal(size=shape + (CLASSES,)).astype("float32"))
        cases = [  # (ours, Keras's, labels for ours, labels for Keras, sample weight)
            (tfmp.ChunkedSparseCategoricalCrossentropy(chunk_bytes=CHUNK),
             keras.losses.SparseCategoricalCrossentropy(from_logits=True), ids, ids, None),
            (tfmp.ChunkedSparseCategoricalCrossentropy(ignore_class=0, chunk_bytes=CHUNK),
             keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0), ids, ids, weight),
            (tfmp.ChunkedSparseCategoricalCrossentropy(label_smoothing=0.1, reduction="sum", chunk_bytes=CHUNK),
             keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1, reduction="sum"),
             ids, one_hot, weight),
            (tfmp.ChunkedCategoricalCrossentropy(label_smoothing=0.2, chunk_bytes=CHUNK),
             keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.2),
             probabilities, probabilities, weight),
        ]
        values = tf.cast(logits, tf.float32).numpy()
        values[ids == 0] = np.nan  # Keras's ignore_class takes ignored rows' logits as zeros
        poisoned = tf.cast(values, dtype)
        for ours, reference, labels, keras_labels, sample_weight in cases:
            inputs = poisoned if getattr(ours, "ignore_class", None) is not None else logits
            value, grad = _ours(ours, labels, inputs, sample_weight)
            expected, expected_grad = _keras_loss_and_grad(reference, keras_labels, inputs, sample_weight)
            where = (dtype, shape, ours.get_config())
            assert value.dtype == tf.float32 and grad.dtype == dtype, where
            np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=2e-6, err_msg=str(where))
            # the gradient: float32 math rounded once to the logits' dtype
            np.testing.assert_allclose(tf.cast(grad, tf.float32).numpy(), expected_grad.numpy(),
                                       rtol=EPS[dtype], atol=1e-7, err_msg=str(where))
            if getattr(ours, "ignore_class", None) is not None:
                assert not np.any(tf.cast(grad, tf.float32).numpy()[ids == 0]), where


def _large_float32(function, args, elements):
    """(op type, shape) of every float32 op output of ``elements`` or more in ``function``'s traced graphs."""
    concrete = tf.function(function).get_concrete_function(*args)
    graphs = [concrete.graph] + [f.graph for f in concrete.graph._functions.values()]
    return [(op.type, tuple(out.shape)) for graph in graphs for op in graph.get_operations()
            for out in op.outputs if out.dtype == tf.float32 and out.shape.rank
            and out.shape.is_fully_defined() and out.shape.num_elements() >= elements]


def _language_model(loss):
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(CLASSES, 16)(tokens)
    x = keras.layers.Dense(16, activation="relu")(x)
    model = keras.Model(tokens, keras.layers.Dense(CLASSES, name="logits")(x))
    model.compile(keras.optimizers.SGD(0.1), loss=loss)  # XLA in the XLA tier (tests/_xla.py)
    return model


def _step_graph(model, x, y):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x, y, model(x, training=True), training=True)
        return tape.gradient(loss, model.trainable_variables)

    return _large_float32(step, (x, y), elements=int(np.prod(y.shape)) * CLASSES)


def test_a_model_trains_under_tfmp_without_float32_logits_and_saves(tmp_path):
    """Under tfmp the logits layer stays bfloat16, uncast; the step holds no float32 tensor of the
    logits' size where Keras's loss has one; two epochs lower the loss (compiled by XLA in the XLA
    tier, whose `jit_compile="auto"` is XLA); the compiled model saves and loads with its loss."""
    rng = np.random.default_rng(3)
    x = tf.constant(rng.integers(0, CLASSES, size=(4, 8)), tf.int32)
    y = tf.constant(rng.integers(0, CLASSES, size=(4, 8)), tf.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 16 bits on a CPU: PerformanceWarning
        with tfmp.policy_scope("mixed_bfloat16", verbose=False):
            ours = _language_model(tfmp.ChunkedSparseCategoricalCrossentropy(ignore_class=0, chunk_bytes=CHUNK))
            kerass = _language_model(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    found = tfmp.attachment(ours)
    assert found.forced_float32["logits"] == LOGITS_16BIT
    assert ours.outputs[0].dtype == ours.get_layer("logits").compute_dtype == "bfloat16"
    assert _step_graph(ours, x, y) == []  # no float32 tensor of the logits' size, forward or backward
    assert ("Cast", (4, 8, CLASSES)) in _step_graph(kerass, x, y)  # tfmp's logits cast for Keras's loss
    before = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)(
        y, tf.cast(ours(x), tf.float32))
    history = ours.fit(x, y, batch_size=4, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(history[0], before.numpy(), rtol=1e-5)  # the first step's loss: Keras's
    assert history[1] < history[0], history
    assert ours.jit_compile is _xla.xla_tier()  # XLA-compiled in the XLA tier
    path = str(tmp_path / "lm.keras")
    ours.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.loss) is tfmp.ChunkedSparseCategoricalCrossentropy
    assert loaded.loss.get_config() == ours.loss.get_config()


def test_rows_per_chunk_follows_the_byte_budget():
    assert chunked_cross_entropy.rows_per_chunk(32_000) == 262  # 32 MiB of float32 rows of 32k
    assert chunked_cross_entropy.rows_per_chunk(256_000, 2**20) == 1
