"""The chunked cross-entropies fused with the output projection (tfmp/_src/float32/fused_cross_entropy.py,
tfmp/_src/keras_hooks/projection_graph.py) against Keras's float32 loss on the layer's own logits.

Expected values: Keras's ``SparseCategoricalCrossentropy`` / ``CategoricalCrossentropy`` (from logits)
on the projection layer's logits (computed unfused, traced as a training step traces the layer) cast to
float32, and their gradient by ``tf.GradientTape``, carried to hidden states, kernel and bias by numpy's
float64 matmuls.
Inputs are multiples of 1/4 and 1/8 (sums of up to 11 bits: exact in float32, rounded in 16 bits), so the layer's 16-bit
logits are the same whichever order its kernel sums in.
"""

import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from _subproc import ROOT, script_env
from tfmp._src.float32 import fused_cross_entropy
from tfmp._src.keras_hooks import availability, projection_graph

CLASSES, DEPTH = 40, 8
#: Bytes of one block: 6 or 7 columns of 12 or 10 rows, so the last block of 40 classes has dead columns.
CHUNK = 300
EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def _layer(policy, bias, tied, rng):
    """A built output projection of ``policy`` with exactly representable weights (multiples of 1/8)."""
    if tied:
        layer = keras.layers.ReversibleEmbedding(CLASSES, DEPTH, dtype=policy)
        layer.build((None,))
        layer.embeddings.assign(rng.integers(-12, 13, size=(CLASSES, DEPTH)) / 8)
        return layer, lambda h: layer(h, reverse=True), [layer.embeddings]
    layer = keras.layers.Dense(CLASSES, use_bias=bias, dtype=policy)
    layer.build((None, DEPTH))
    layer.kernel.assign(rng.integers(-12, 13, size=(DEPTH, CLASSES)) / 8)
    if bias:
        layer.bias.assign(rng.integers(-8, 9, size=(CLASSES,)) / 8)
    return layer, layer, layer.trainable_weights


def _reference(loss, labels, hidden, call, weights, sample_weight):
    """Keras's float32 loss on the layer's logits as a traced step computes them; gradients to hidden and
    weights in float64; and for each gradient the bound of what rounding the logits' gradient to 16 bits
    can move it by: 0 where this machine runs the loss's matmuls in float32, else ``EPS * (|g| @ |x|)``
    (Keras's own backward rounds that gradient once, the fused loss its softmax part and scaled rows)."""
    logits = tf.cast(tf.function(call)(hidden), tf.float32)  # traced: oneDNN may fuse the bias in one rounding
    with tf.GradientTape() as tape:
        tape.watch(logits)
        value = loss(labels, logits, sample_weight=sample_weight)
    g = tape.gradient(value, logits).numpy().astype("float64").reshape(-1, CLASSES)
    h = tf.cast(hidden, tf.float64).numpy().reshape(-1, DEPTH)
    kernel = weights[0].numpy().astype("float64")
    tied = kernel.shape == (CLASSES, DEPTH)

    def gradients(g, h, kernel):
        found = [(g @ (kernel if tied else kernel.T)).reshape(hidden.shape), (g.T @ h) if tied else (h.T @ g)]
        return found + ([g.sum(axis=0)] if len(weights) > 1 else [])

    rounding = 0.0 if fused_cross_entropy.float32_matmul(hidden.dtype) else 2 * EPS[hidden.dtype.name]
    return value.numpy(), gradients(g, h, kernel), [rounding * b for b in gradients(abs(g), abs(h), abs(kernel))]


#: (dtype, hidden's shape without depth, bias, tied embedding): 2-D and 3-D, bias and none, both 16-bit dtypes.
LAYERS = [("bfloat16", (12,), True, False), ("bfloat16", (3, 4), False, True), ("float16", (2, 5), True, False)]


@pytest.mark.parametrize("dtype, shape, bias, tied", LAYERS)
def test_fused_loss_and_gradients_equal_kerass_float32_loss_on_the_layers_logits(dtype, shape, bias, tied):
    rng = np.random.default_rng(5)
    hidden = tf.constant(rng.integers(-12, 13, size=shape + (DEPTH,)) / 4, dtype)
    ids = rng.integers(1, CLASSES, size=shape)
    ids.flat[::3] = 0  # the ignored class
    weight = rng.uniform(0.5, 2.0, size=shape[:1] + (1,) * (len(shape) - 1)).astype("float32")
    probabilities = tf.nn.softmax(rng.normal(size=shape + (CLASSES,)).astype("float32"))
    cases = [  # (ours, Keras's, labels, sample weight): a uniform upstream gradient, then per-row weights
        (tfmp.ChunkedSparseCategoricalCrossentropy(ignore_class=0, chunk_bytes=CHUNK),
         keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0), ids, None),
        (tfmp.ChunkedSparseCategoricalCrossentropy(ignore_class=0, reduction="sum", chunk_bytes=CHUNK),
         keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0, reduction="sum"),
         ids, weight),
        (tfmp.ChunkedCategoricalCrossentropy(label_smoothing=0.2, chunk_bytes=CHUNK),
         keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.2), probabilities, None),
        (tfmp.ChunkedCategoricalCrossentropy(chunk_bytes=CHUNK),
         keras.losses.CategoricalCrossentropy(from_logits=True), probabilities, weight),
    ]
    layer, call, weights = _layer(f"mixed_{dtype}", bias, tied, rng)
    found = []

    @tf.function(autograph=False)
    def step(hidden):  # every case in one trace
        out = []
        for ours, _, labels, sample_weight in cases:
            with tf.GradientTape() as tape:
                tape.watch(hidden)
                logits = call(hidden)
                found.append(projection_graph.output_projection(logits))
                value = ours(labels, logits, sample_weight=sample_weight)
            out.append((value, tape.gradient(value, [hidden] + weights)))
        return out

    for (value, grads), (ours, reference, labels, sample_weight), projection in zip(step(hidden), cases, found):
        expected, expected_grads, bounds = _reference(reference, labels, hidden, call, weights, sample_weight)
        where = (ours.get_config(), sample_weight is not None)
        assert projection is not None and projection.kernel.dtype == tf.float32, where  # fused, from the variable
        np.testing.assert_allclose(value.numpy(), expected, rtol=2e-6, err_msg=str(where))
        for got, want, bound, name in zip(grads, expected_grads, bounds, ["hidden", "kernel", "bias"]):
            assert got.dtype == (dtype if name == "hidden" else "float32"), (where, name)
            error = np.abs(tf.cast(got, tf.float64).numpy() - want)
            allowed = EPS[dtype] * np.abs(want) + 1e-6 * np.abs(want).max() + bound
            assert (error <= allowed).all(), (where, name, float((error - allowed).max()))


def _large_tensors(function, args, elements):
    """(op type, shape) of every op output of ``elements`` or more that TensorFlow runs in ``function``:
    the outer graph's ops the outputs depend on (the runtime prunes the others), and every op of the
    functions it calls (loop bodies)."""
    concrete = tf.function(function).get_concrete_function(*args)
    graph = concrete.graph
    pending = [t.op for t in graph.outputs] + list(graph.control_outputs)
    seen = set()
    while pending:
        op = pending.pop()
        if op.name not in seen:
            seen.add(op.name)
            pending += [t.op for t in op.inputs] + list(op.control_inputs)
    ops = [graph.get_operation_by_name(name) for name in seen]
    ops += [op for inner in graph._functions.values() for op in inner.graph.get_operations()]
    return [(op.type, tuple(out.shape)) for op in ops for out in op.outputs
            if out.shape.rank and out.shape.is_fully_defined() and out.shape.num_elements() >= elements]


def _language_model(loss, metrics=()):
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(CLASSES, 16)(tokens)
    x = keras.layers.Dense(16, activation="relu")(x)
    model = keras.Model(tokens, keras.layers.Dense(CLASSES, name="logits")(x))
    model.compile(keras.optimizers.SGD(0.1), loss=loss, metrics=list(metrics))
    return model


def test_the_fused_training_step_runs_no_tensor_of_the_logits_size_and_a_metric_still_reads_kerass_logits():
    """Under tfmp (logits bfloat16): the step's gradients need no logits-sized tensor where the
    unfused chunked loss has the bfloat16 logits; a metric on the logits keeps them and reads
    Keras's values; the first step's loss is Keras's float32 loss on the model's logits."""
    rng = np.random.default_rng(3)
    x = tf.constant(rng.integers(0, CLASSES, size=(4, 8)), tf.int32)
    y = tf.constant(rng.integers(0, CLASSES, size=(4, 8)), tf.int32)
    size = int(np.prod(y.shape)) * CLASSES
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 16 bits on a CPU: PerformanceWarning
        with tfmp.policy_scope("mixed_bfloat16", verbose=False):
            keras.utils.set_random_seed(0)
            fused = _language_model(tfmp.ChunkedSparseCategoricalCrossentropy(chunk_bytes=CHUNK))
            keras.utils.set_random_seed(0)
            metric = keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")
            watched = _language_model(tfmp.ChunkedSparseCategoricalCrossentropy(chunk_bytes=CHUNK), [metric])
            unfused = _language_model(tfmp.ChunkedSparseCategoricalCrossentropy(chunk_bytes=CHUNK,
                                                                                fuse_projection=False))

    def step_of(model):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = model.compute_loss(x, y, model(x, training=True), training=True)
            return tape.gradient(loss, model.trainable_variables)
        return step

    assert _large_tensors(step_of(fused), (x, y), size) == []
    assert ("MatMul", (32, CLASSES)) in _large_tensors(step_of(unfused), (x, y), size)
    logits = watched(x)
    expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, tf.cast(logits, tf.float32))
    kerass = keras.metrics.SparseCategoricalCrossentropy(from_logits=True)
    kerass.update_state(y, logits)
    logs = watched.train_on_batch(x, y, return_dict=True)
    # the metric reads the logits the layer outputs (Keras computes it in bfloat16: XLA may round otherwise)
    np.testing.assert_allclose(logs["xent"], kerass.result().numpy(), rtol=2.0**-8)
    # the step's matmul may sum in another order than the eager call's: a bfloat16 logit one unit off
    np.testing.assert_allclose(logs["loss"], expected.numpy(), rtol=2e-5)


def test_eager_logits_and_other_ops_are_not_fused_and_a_keras_that_moved_the_pattern_turns_it_off(monkeypatch):
    """No projection from an eager tensor, a soft cap or a non-projection op; where Keras's Dense no
    longer traces to the pattern, the feature goes off with one warning and the loss still computes."""
    dense = keras.layers.Dense(CLASSES)
    hidden = tf.ones((2, DEPTH))
    assert projection_graph.output_projection(dense(hidden)) is None  # eager
    seen = []

    @tf.function(autograph=False)
    def traced(h):
        logits = dense(h)
        seen.extend(projection_graph.output_projection(t) for t in (logits, tf.tanh(logits) * 3.0, logits * 2.0))
        return logits

    traced(hidden)
    traces = [seen[i:i + 3] for i in range(0, len(seen), 3)]  # TensorFlow may trace the function twice
    assert traces and all(t[0] is not None and t[0].transpose is False and t[1:] == [None, None] for t in traces)
    projection_graph.forget()
    monkeypatch.setattr(projection_graph, "_walk", lambda logits: None)  # "Keras moved the pattern"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not projection_graph.pattern_matches() and not projection_graph.pattern_matches()
            loss = tfmp.ChunkedSparseCategoricalCrossentropy()
            value = tf.function(lambda h: loss(tf.zeros((2,), tf.int32), dense(h)))(hidden)
        said = [str(w.message) for w in caught if "turned one feature off" in str(w.message)]
        assert len(said) == 1 and availability.FEATURES["fused_projection"] in said[0], said
        np.testing.assert_allclose(value.numpy(), keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            tf.zeros((2,), tf.int32), dense(hidden)).numpy(), rtol=1e-6)
    finally:
        projection_graph.forget()
        availability.clear()


_COMPILES_SCRIPT = """
import warnings; warnings.simplefilter("ignore")
import numpy as np, keras, tfmp
keras.utils.set_random_seed(1)
keras.config.set_dtype_policy("mixed_bfloat16")
tokens = keras.Input((8,), dtype="int32")
x = keras.layers.Embedding(40, 16)(tokens)
model = keras.Model(tokens, keras.layers.Dense(40)(x))
model.compile("sgd", tfmp.ChunkedSparseCategoricalCrossentropy(ignore_class=0, chunk_bytes=480), jit_compile=True)
rng = np.random.default_rng(0)
model.fit(rng.integers(0, 40, (24, 8)), rng.integers(0, 40, (24, 8)), batch_size=8, shuffle=False, verbose=0)
"""


def test_under_xla_the_fused_train_step_compiles_once():
    env = script_env({"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "device_compiler=1"})
    run = subprocess.run([sys.executable, "-c", _COMPILES_SCRIPT], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("Compilation of XLA executable") == 1, run.stderr[-3000:]
