"""The sparse cross-entropy read from 16-bit logits: its values, the per-model decision, the hook.

Every expected value is TensorFlow's own ``sparse_softmax_cross_entropy_with_logits`` on the
logits cast to float32, as plain Keras computes it. The decision rests on the machine's facts:
a CPU (a Zen 4 made this machine's with `injected_facts`) takes the fused passes, a GPU machine
(an A100) Keras's cross-entropy, so both branches run on any CPU; no test asserts a time.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.float32 import cross_entropy
from tfmp._src.keras_hooks import backend_ops, contracts, projection_graph
from tfmp._src.policy.hardware import injected_facts
from _machines import A100, SAPPHIRE_RAPIDS, XEON_NO_BF16, ZEN4
from _xla import not_under_xla

pytestmark = pytest.mark.usefixtures("restore_probe_caches")

TOKENS, VOCABULARY, BATCH = 6, 40, 8
RNG = np.random.default_rng(0)
X = RNG.integers(0, VOCABULARY, size=(2 * BATCH, TOKENS))
Y = RNG.integers(0, VOCABULARY, size=(2 * BATCH, TOKENS))
#: TensorFlow's own cross-entropy op, which the fused passes replace in an attached step.
KERNEL = "SparseSoftmaxCrossEntropyWithLogits"


def _kernel_loss_and_gradient(labels, logits, upstream):
    """TensorFlow's cross-entropy of `logits` cast to float32, and its gradient cast back, as Keras has them."""
    with tf.GradientTape() as tape:
        tape.watch(logits)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.cast(logits, tf.float32))
    return losses, tape.gradient(losses, logits, output_gradients=upstream)


def _fused_loss_and_gradient(labels, logits, upstream):
    with tf.GradientTape() as tape:
        tape.watch(logits)
        losses = cross_entropy.fused(labels, logits)
    return losses, tape.gradient(losses, logits, output_gradients=upstream)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("block_rows", [None, 7])  # None: one block; 7: 43 blocks, the last overlapping
def test_the_fused_passes_equal_tensorflows_cross_entropy_of_the_logits_cast_to_float32(dtype, block_rows, monkeypatch):
    rows, classes = 300, 1000
    if block_rows:
        monkeypatch.setattr(cross_entropy, "BLOCK_BYTES", 4 * classes * block_rows)
    wide = tf.random.stateless_normal((rows, classes), seed=(3, 4)) * 6.0
    # rows whose largest logit is far above the others (exp overflows float32 without the shift)
    wide = tf.tensor_scatter_nd_update(wide, [[0, 5], [1, 999], [2, 0]], [3.0e4, 2.0e4, -3.0e4])
    logits = tf.cast(wide, dtype)
    labels = tf.constant(np.random.default_rng(5).integers(0, classes, rows))
    labels = tf.tensor_scatter_nd_update(labels, [[0]], [5])  # row 0: its label is the peak
    upstream = tf.random.stateless_uniform((rows,), seed=(6, 7), minval=0.1, maxval=3.0)
    expected, expected_gradient = _kernel_loss_and_gradient(labels, logits, upstream)
    found, gradient = _fused_loss_and_gradient(labels, logits, upstream)
    assert (found.dtype, found.shape, gradient.dtype, gradient.shape) == (tf.float32, (rows,), logits.dtype, logits.shape)
    np.testing.assert_allclose(found.numpy(), expected.numpy(), rtol=2e-6, atol=2e-6)
    # both rounded once from float32 softmax values: within one step of the 16-bit dtype
    step = 2.0 ** (-7 if dtype == "bfloat16" else -10)
    expected_gradient = tf.cast(expected_gradient, tf.float64).numpy()
    np.testing.assert_allclose(tf.cast(gradient, tf.float64).numpy(), expected_gradient,
                               rtol=step, atol=1e-6 * np.abs(expected_gradient).max())


def test_a_label_outside_the_classes_raises_as_tensorflows_kernel_does_and_is_nan_under_xla():
    logits = tf.cast(tf.random.stateless_normal((4, 10), seed=(1, 1)), tf.bfloat16)
    graph = tf.function(cross_entropy.fused)
    for wrong in (10, -1):
        with pytest.raises(tf.errors.InvalidArgumentError,  # names the label and where it is
                           match=rf"outside the valid range of \[0, 10\): label\] \[{wrong}\] \[at flat position\] \[2\]"):
            graph(tf.constant([0, 1, wrong, 3]), logits)
        with pytest.raises(tf.errors.InvalidArgumentError):  # TensorFlow's own kernel, as plain Keras runs it
            tf.function(tf.nn.sparse_softmax_cross_entropy_with_logits)(
                tf.constant([0, 1, wrong, 3]), tf.cast(logits, tf.float32))
        found = tf.function(cross_entropy.fused, jit_compile=True)(tf.constant([0, 1, wrong, 3]), logits).numpy()
        assert np.isnan(found[2]) and np.isfinite(found[[0, 1, 3]]).all()  # tfmp's guard skips that step



def test_under_xla_a_label_outside_the_classes_skips_the_step_and_the_warning_names_labels():
    with tfmp.policy_scope("mixed_bfloat16", verbose=False):
        keras.utils.set_random_seed(1)
        model = _decoder()
        model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
        before = [w.numpy() for w in model.weights]
        tokens = np.zeros((2, TOKENS), "int32")
        labels = np.ones((2, TOKENS), "int32")
        labels[1, 2] = VOCABULARY  # one label out of range
        with pytest.warns(tfmp.SkippedStepWarning, match=r"under XLA, check labels"):
            model.fit(tokens, labels, epochs=1, verbose=0)
        assert int(model.optimizer.overflow_count.numpy()) == 1
        for old, new in zip(before, model.weights):
            np.testing.assert_array_equal(old, new.numpy())

def test_the_decision_rests_on_the_machine_facts_and_measures_nothing():
    for facts in (ZEN4, SAPPHIRE_RAPIDS, XEON_NO_BF16):  # every CPU: TensorFlow's float32 kernel on a cast
        assert cross_entropy.decision("bfloat16", facts) == f"float32 inside: {cross_entropy.RULE}"
        assert cross_entropy.decision("float32", facts) == cross_entropy.decision("float16", facts) == "keras"
    assert cross_entropy.decision("bfloat16", A100) == "keras"


def _decoder():
    """A tiny keras.io-style decoder: token Embedding, Dense, logits Dense, from-logits cross-entropy."""
    inputs = keras.Input((TOKENS,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, 16, name="embedding")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    return keras.Model(inputs, keras.layers.Dense(VOCABULARY, name="logits")(x))


def _compiled(facts, speedups=True, **loss_options):
    with tfmp.policy_scope("mixed_bfloat16", speedups=speedups, verbose=False), injected_facts(facts):
        keras.utils.set_random_seed(1)
        model = _decoder()
        model.compile(keras.optimizers.SGD(0.5),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True, **loss_options))
    return model


def step_ops(model):
    """Op types of `model`'s train step (nested functions included), traced now in a tf.function of our own."""
    step = tf.function(lambda x, y: model.train_step((x, y)))
    graph = step.get_concrete_function(tf.TensorSpec((BATCH, TOKENS), tf.int32),
                                       tf.TensorSpec((BATCH, TOKENS), tf.int64)).graph
    graphs = [graph] + [f.graph for f in graph._functions.values()]
    return [op.type for g in graphs for op in g.get_operations()]


def test_an_attached_bfloat16_model_trains_on_the_fused_passes_and_learns_as_with_kerass_kernel():
    model, keras_kernel = _compiled(ZEN4), _compiled(ZEN4, speedups={"cross_entropy": False})
    assert tfmp.attachment(model).cross_entropy == f"float32 inside: {cross_entropy.RULE}"
    assert tfmp.attachment(keras_kernel).cross_entropy == "keras: speed-up off (tfmp.enable(speedups=...))"
    assert KERNEL not in step_ops(model) and KERNEL in step_ops(keras_kernel)
    weights = [np.array(w) for w in keras_kernel.get_weights()]
    model.set_weights(weights)
    histories = [m.fit(X, Y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0).history["loss"]
                 for m in (model, keras_kernel)]
    np.testing.assert_allclose(histories[0], histories[1], rtol=1e-4)
    assert histories[0][-1] < histories[0][0]
    for found, expected in zip(model.get_weights(), keras_kernel.get_weights()):
        np.testing.assert_allclose(found, expected, rtol=1e-2, atol=1e-3)
    sample_weight = np.linspace(0.0, 2.0, X.size).reshape(X.shape)  # per token
    np.testing.assert_allclose(model.evaluate(X, Y, sample_weight=sample_weight, verbose=0),
                               keras_kernel.evaluate(X, Y, sample_weight=sample_weight, verbose=0), rtol=1e-5)


def test_logits_above_the_size_limit_are_fused_with_the_output_projection_and_learn_as_with_kerass_kernel(
        monkeypatch):
    calls = []
    real = cross_entropy.fused_with_projection
    monkeypatch.setattr(cross_entropy, "fused_with_projection", lambda *a: calls.append(a) or real(*a))
    # the step's logits: BATCH x TOKENS x VOCABULARY bfloat16 values, 2 bytes each
    monkeypatch.setattr(cross_entropy, "FUSED_ABOVE_BYTES", BATCH * TOKENS * VOCABULARY * 2 - 1)
    model, keras_kernel = _compiled(ZEN4), _compiled(ZEN4, speedups={"cross_entropy": False})
    assert KERNEL not in step_ops(model) and calls  # TensorFlow may trace the step more than once
    for labels, projection in calls:
        assert (labels.shape, projection.hidden.shape, projection.kernel.shape, projection.transpose) == \
            ((BATCH * TOKENS,), (BATCH * TOKENS, 16), (16, VOCABULARY), False) and projection.bias is not None
    model.set_weights(keras_kernel.get_weights())
    for m in (model, keras_kernel):  # one step: the gradients differ by their bfloat16 rounding only
        m.train_on_batch(X[:BATCH], Y[:BATCH])
    for found, expected in zip(model.get_weights(), keras_kernel.get_weights()):
        np.testing.assert_allclose(found, expected, rtol=1e-2, atol=1e-3)
    histories = [m.fit(X, Y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0).history["loss"]
                 for m in (model, keras_kernel)]
    np.testing.assert_allclose(histories[0], histories[1], rtol=1e-4)
    assert histories[0][-1] < histories[0][0]
    calls.clear()  # one byte more than the logits: the two passes
    monkeypatch.setattr(cross_entropy, "FUSED_ABOVE_BYTES", BATCH * TOKENS * VOCABULARY * 2)
    assert KERNEL not in step_ops(_compiled(ZEN4)) and not calls


@not_under_xla("XLA may keep either rounding of the logits in excess precision (xla_allow_excess_precision)")
@pytest.mark.parametrize("normalized", [True, False])
def test_the_fused_loss_reads_the_logits_the_layer_computes_with_its_bias_rounded_as_the_layer_rounds_it(
        normalized, monkeypatch):
    """The logits of a Dense on 3-D hidden states: its matmul and its bias add each rounded to bfloat16 (a
    reshape between them: nothing fused). The fused loss's blocks add the bias the same way, never as a
    BiasAdd that TensorFlow's remapper may fuse into their matmul with one rounding."""
    from tfmp._src.float32 import fused_cross_entropy

    rows, classes, depth = 4 * 128, 2000, 32
    monkeypatch.setattr(cross_entropy, "FUSED_ABOVE_BYTES", 0)
    monkeypatch.setattr(fused_cross_entropy, "CHUNK_BYTES", 4 * rows * 256)  # 256 columns a block
    ids = RNG.integers(0, classes, size=(4, 128))
    labels = (ids * 7 + 1) % classes
    models = []
    for speedups in (True, {"cross_entropy": False}):
        with tfmp.policy_scope("mixed_bfloat16", speedups=speedups, verbose=False), injected_facts(ZEN4):
            inputs = keras.Input((128,), dtype="int32")
            x = keras.layers.Embedding(classes, depth)(inputs)
            x = keras.layers.LayerNormalization()(x) if normalized else x
            models.append(keras.Model(inputs, keras.layers.Dense(classes)(x)))
            models[-1].compile(keras.optimizers.Adam(0.05),
                               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fused, keras_kernel = models
    fused.fit(ids, labels, batch_size=4, epochs=3, verbose=0)  # trained: logits of several units
    keras_kernel.set_weights(fused.get_weights())
    np.testing.assert_allclose(fused.evaluate(ids, labels, batch_size=4, verbose=0),
                               keras_kernel.evaluate(ids, labels, batch_size=4, verbose=0), rtol=1e-6)


def test_the_size_limit_counts_the_logits_bytes_and_needs_their_shape():
    limit = cross_entropy.FUSED_ABOVE_BYTES
    assert cross_entropy.takes_projection(tf.TensorSpec((limit // 2 + 1,), tf.bfloat16))
    assert not cross_entropy.takes_projection(tf.TensorSpec((limit // 2,), tf.bfloat16))
    assert not cross_entropy.takes_projection(tf.TensorSpec((None, 2**30), tf.bfloat16))  # rows unknown


def test_a_label_outside_the_classes_raises_or_is_nan_where_the_loss_is_fused_with_the_projection():
    hidden = tf.cast(tf.random.stateless_normal((4, 3), seed=(1, 2)), tf.bfloat16)
    kernel, bias = tf.random.stateless_normal((3, 10), seed=(2, 3)), tf.zeros((10,))
    projection = projection_graph.Projection(hidden, kernel, False, bias, tf.bfloat16)
    logits = tf.nn.bias_add(tf.matmul(hidden, tf.cast(kernel, tf.bfloat16)), tf.cast(bias, tf.bfloat16))
    good = tf.constant([0, 1, 9, 3])
    expected = tf.nn.sparse_softmax_cross_entropy_with_logits(good, tf.cast(logits, tf.float32))
    np.testing.assert_allclose(tf.function(lambda y: cross_entropy.fused_with_projection(y, projection))(good),
                               expected, rtol=1e-5)
    for wrong in (10, -1):
        labels = tf.constant([0, 1, wrong, 3])
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"outside the valid range of \[0, 10\)"):
            tf.function(lambda y: cross_entropy.fused_with_projection(y, projection))(labels)
        found = tf.function(lambda y: cross_entropy.fused_with_projection(y, projection), jit_compile=True)(labels)
        assert np.isnan(found[2]) and np.isfinite(tf.gather(found, [0, 1, 3])).all()


def test_ignore_class_and_another_axis_keep_kerass_cross_entropy_with_its_value():
    model = _compiled(ZEN4, ignore_class=0)
    assert KERNEL in step_ops(model)  # Keras zeroes the ignored rows' logits (a Select, not a cast)
    plain = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    logits = tf.cast(model(X), tf.float32)
    np.testing.assert_allclose(model.evaluate(X, Y, batch_size=len(X), verbose=0), float(plain(Y, logits)), rtol=1e-5)


def test_where_a_gpu_runs_the_steps_and_after_detach_the_model_traces_kerass_kernel():
    gpu = _compiled(A100)
    assert tfmp.attachment(gpu).cross_entropy == "keras" and KERNEL in step_ops(gpu)
    model = _compiled(ZEN4)
    assert KERNEL not in step_ops(model)
    tfmp.detach(model)
    assert KERNEL in step_ops(model)


def test_a_model_tfmp_did_not_attach_traces_kerass_kernel_while_the_hook_is_on():
    attached = _compiled(ZEN4)
    with tfmp.policy_scope("mixed_bfloat16", verbose=False), injected_facts(ZEN4):
        keras.config.set_dtype_policy("mixed_bfloat16")  # restored by the conftest fixture
        plain = _decoder()
        plain.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with tfmp.policy_scope("mixed_bfloat16", verbose=False):  # the backend hook on while the step traces
        tfmp.detach(plain)  # compiled by tfmp: detached, it is Keras's
        assert KERNEL in step_ops(plain) and KERNEL not in step_ops(attached)


def test_keras_still_calls_the_backend_cross_entropy_on_logits_cast_to_float32():
    """The contract the hook rests on: Keras's loss casts 16-bit logits up, then calls ``backend.nn``'s function."""
    function = backend_ops.backend_nn().sparse_categorical_crossentropy
    assert list(inspect.signature(function).parameters) == ["target", "output", "from_logits", "axis"]
    assert any("sparse_categorical_crossentropy" in row for row, _ in contracts.CALL_ORDER)
    seen = []

    def record(call):
        seen.append((call.exact, cross_entropy.sixteen_bit_logits(call.inputs[1]) is not None))
        return backend_ops.KERAS

    hook = backend_ops.subscribe("sparse_categorical_crossentropy", record, owner="cross_entropy")
    try:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        logits = tf.zeros((2, 3, 5), tf.bfloat16)
        tf.function(lambda y, z: loss(y, z))(tf.zeros((2, 3), tf.int32), logits)
    finally:
        hook.remove()
    assert seen == [(True, True)]


def test_the_benchmark_runs_and_its_table_hangs_together(tmp_path):
    from _benchmarks import quick_run

    benchmark, written = quick_run("cross_entropy", tmp_path)
    (row,) = written["timings"]
    assert (row["shape"], row["size"]) == ("tiny", [64, 50]) and 1 <= row["rounds"] <= 2
    assert row["fastest_ratio"] == pytest.approx(row["keras_ms"] / row["fused_ms"]) and row["paired_ratio"] > 0
    assert row["loss_relative_difference"] < 1e-6 and row["gradient_difference"] <= 2.0**-7  # one bfloat16 step
    assert "| tiny (64 x 50) |" in benchmark.markdown(written)
