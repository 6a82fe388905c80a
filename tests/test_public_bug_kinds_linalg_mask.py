"""Issue 53 items 4 and 5: linalg ops and an additive -1e9 mask in a user layer under 16-bit policies.

Each test runs the same model beside a float32 reference (same weights) and beside plain
Keras (`keras.config.set_dtype_policy`, no tfmp), which fails or is off first, so the case
stays a real one. tfmp computes the layer in float32 (`tfmp/_src/float32/unsafe_ops.py`); its
output is handed back in the 16-bit dtype, so tfmp matches float32 within a few roundings of
that dtype: `STEP` is its spacing relative to a value (2**-7 bfloat16, 2**-10 float16).
"""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import tfmp
from tfmp._src.float32.unsafe_ops import UnsafeOps

STEP = {"mixed_bfloat16": 2.0**-7, "mixed_float16": 2.0**-10}
X4 = np.random.RandomState(0).randn(16, 4).astype("float32")
Y4 = np.random.RandomState(1).randn(16, 1).astype("float32")
X6 = np.random.RandomState(0).randn(16, 6, 8).astype("float32")
Y6 = np.random.RandomState(1).randn(16, 1).astype("float32")
#: The TensorFlow op each `keras.ops` call of `LinalgLayer` runs.
OP_TYPES = {"cholesky": "Cholesky", "inv": "MatrixInverse", "qr": "Qr", "slogdet": "LogMatrixDeterminant"}


class LinalgLayer(keras.layers.Layer):
    """A user layer: each row's matrix x x^T + 0.05 I (condition number about 100), then one linalg op."""

    def __init__(self, op, **kwargs):
        super().__init__(**kwargs)
        self.op = op

    def call(self, x):
        n = x.shape[-1]
        a = ops.expand_dims(x, -1) * ops.expand_dims(x, -2) + ops.eye(n, dtype=x.dtype) * 0.05
        if self.op == "cholesky":
            return ops.sum(keras.ops.linalg.cholesky(a), axis=-1)
        if self.op == "inv":
            return ops.sum(keras.ops.linalg.inv(a), axis=-1)
        if self.op == "qr":
            return ops.sum(keras.ops.linalg.qr(a)[1], axis=-1)
        return ops.repeat(ops.expand_dims(ops.slogdet(a)[1], -1), n, axis=-1)


class MaskedSelfAttention(keras.layers.Layer):
    """Causal self-attention whose scores get the additive mask ``(1 - causal) * mask_value``."""

    def __init__(self, mask_value, **kwargs):
        super().__init__(**kwargs)
        self.mask_value = mask_value
        self.q, self.k, self.v = (keras.layers.Dense(8, name=name) for name in "qkv")

    def call(self, x):
        scores = ops.matmul(self.q(x), ops.transpose(self.k(x), (0, 2, 1))) / 8**0.5
        causal = ops.cast(ops.tril(ops.ones((x.shape[1], x.shape[1]))), scores.dtype)
        scores = scores + (1.0 - causal) * self.mask_value
        return ops.matmul(ops.softmax(scores, axis=-1), self.v(x))


def _linalg_model(op):
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(LinalgLayer(op, name="lin")(inputs)))


def _attention_model(mask_value):
    inputs = keras.Input((6, 8))
    hidden = MaskedSelfAttention(mask_value, name="attn")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(keras.layers.Flatten()(hidden)))


def _run(model, weights, x, y, steps=3, lr=1e-3):
    """(predictions, per-step losses) of `model` from `weights`, trained `steps` full batches with SGD."""
    model.set_weights(weights)
    model.compile(keras.optimizers.SGD(lr), "mse")
    predictions = model.predict(x, verbose=0)
    return predictions, np.array(model.fit(x, y, epochs=steps, batch_size=len(x), verbose=0).history["loss"])


def _reference(build, x, y):
    """(weights, float32 result of `_run`): the float32 reference."""
    keras.utils.set_random_seed(0)
    model = build()
    weights = model.get_weights()
    return weights, _run(build(), weights, x, y)


def _plain(policy, build):
    """`build()` under plain Keras and `policy` (restored by conftest)."""
    keras.config.set_dtype_policy(policy)
    try:
        return build()
    finally:
        keras.config.set_dtype_policy("float32")


def _rows(model):
    return {row.path: (row.compute_dtype, row.why) for row in tfmp.audit(model).rows}


def _assert_close(got, reference, relative):
    """Predictions and losses within `relative` of the reference's largest magnitude (losses: each own)."""
    (predictions, losses), (ref_predictions, ref_losses) = got, reference
    assert predictions.dtype == np.float32
    np.testing.assert_allclose(predictions, ref_predictions, rtol=0, atol=relative * np.abs(ref_predictions).max())
    np.testing.assert_allclose(losses, ref_losses, rtol=relative)


@pytest.mark.parametrize("op", sorted(OP_TYPES))
def test_linalg_layer_builds_and_trains_under_bfloat16(op):
    """TensorFlow has no bfloat16 linalg op: plain Keras fails while it builds the Functional model.
    tfmp computes the layer in float32 from that build on, says why, and matches float32."""
    with pytest.raises((TypeError, ValueError), match="DataType bfloat16 not in list of allowed values"):
        _plain("mixed_bfloat16", lambda: _linalg_model(op))
    weights, reference = _reference(lambda: _linalg_model(op), X4, Y4)
    try:
        with tfmp.policy_scope("mixed_bfloat16"):
            model = _linalg_model(op)
            got = _run(model, weights, X4, Y4)
        assert _rows(model)["lin"] == ("float32", f"16-bit linalg: {OP_TYPES[op]} in bfloat16")
        _assert_close(got, reference, 2 * STEP["mixed_bfloat16"])
    finally:
        tfmp.disable()


@pytest.mark.parametrize("op, plain_fails", [("cholesky", True), ("inv", False), ("qr", False), ("slogdet", True)])
def test_linalg_layer_under_float16_has_its_kernel_and_float32_accuracy(op, plain_fails):
    """Plain Keras under mixed_float16: Cholesky and LogMatrixDeterminant have no float16 CPU
    kernel (fit fails with "No OpKernel"); MatrixInverse and Qr run, further off float32 than the
    bound tfmp's layer keeps (2 float16 steps of the output's magnitude: TensorFlow 2.21 over 1%,
    tf-nightly 2.23's Qr 0.5%). tfmp's layer runs in float32 and matches float32 within that bound."""
    weights, reference = _reference(lambda: _linalg_model(op), X4, Y4)
    plain = _plain("mixed_float16", lambda: _linalg_model(op))
    if plain_fails:
        with pytest.raises(tf.errors.InvalidArgumentError, match=f"No OpKernel .* '{OP_TYPES[op]}'"):
            _run(plain, weights, X4, Y4)
    else:
        predictions, _ = _run(plain, weights, X4, Y4)
        assert np.abs(predictions - reference[0]).max() > 2 * STEP["mixed_float16"] * np.abs(reference[0]).max()
    try:
        with tfmp.policy_scope("mixed_float16"):
            model = _linalg_model(op)
            got = _run(model, weights, X4, Y4)
        assert _rows(model)["lin"] == ("float32", f"16-bit linalg: {OP_TYPES[op]} in float16")
        _assert_close(got, reference, 2 * STEP["mixed_float16"])
    finally:
        tfmp.disable()


def test_additive_mask_of_minus_1e9_trains_finite_under_float16():
    """-1e9 is -inf in float16 and 0 * -inf is NaN: plain Keras's loss is NaN from the first
    step on. tfmp computes the attention layer (and its Dense sublayers) in float32, names the
    constant, and its losses match float32's."""
    build = lambda: _attention_model(-1e9)  # noqa: E731
    weights, reference = _reference(build, X6, Y6)
    _, plain_losses = _run(_plain("mixed_float16", build), weights, X6, Y6)
    assert np.isnan(plain_losses).all()
    try:
        with tfmp.policy_scope("mixed_float16"):
            model = build()
            got = _run(model, weights, X6, Y6)
        rows = _rows(model)
        assert rows["attn"] == ("float32", "16-bit constant: -1e+09 is not finite in float16")
        assert rows["attn/q"] == ("float32", "inside attn")
        _assert_close(got, reference, 2 * STEP["mixed_float16"])
    finally:
        tfmp.disable()


def test_an_exclusion_switches_the_mask_rule_off():
    """`tfmp.register_float32("attn", exclude=True)`: the layer stays float16, and so NaN."""
    weights, _ = _reference(lambda: _attention_model(-1e9), X6, Y6)
    try:
        with tfmp.register_float32("attn", exclude=True), tfmp.policy_scope("mixed_float16"):
            model = _attention_model(-1e9)
            model.set_weights(weights)
            model.compile(keras.optimizers.SGD(1e-3), "mse")
            assert _rows(model)["attn"] == ("float16", "")
            assert np.isnan(model.predict(X6, verbose=0)).all()
    finally:
        tfmp.disable()


def test_an_excluded_bfloat16_linalg_layer_fails_naming_the_layer_the_op_and_the_fix():
    """Excluded, the layer cannot be computed in bfloat16 at all: the build error says which
    layer, which op, and how to get float32 back."""
    try:
        with tfmp.register_float32(LinalgLayer, exclude=True), tfmp.policy_scope("mixed_bfloat16"):
            with pytest.raises(TypeError) as caught:
                _linalg_model("inv")
        message = str(caught.value)
        assert "Layer 'lin' (LinalgLayer) runs MatrixInverse on bfloat16 inputs" in message
        assert "keeps it out of float32" in message and "remove the exclusion matching 'lin'" in message and 'dtype="float32"' in message
    finally:
        tfmp.disable()


@pytest.mark.parametrize("policy, mask_value", [("mixed_float16", -3e4), ("mixed_bfloat16", -1e9)])
def test_a_constant_the_16_bit_dtype_holds_is_not_forced(policy, mask_value):
    """-3e4 is finite in float16 (largest 65504), -1e9 in bfloat16 (largest about 3.4e38):
    the attention layer keeps its 16-bit policy and trains finite."""
    try:
        with tfmp.policy_scope(policy):
            model = _attention_model(mask_value)
            model.compile(keras.optimizers.SGD(1e-3), "mse")
            losses = model.fit(X6, Y6, epochs=2, batch_size=16, verbose=0).history["loss"]
        assert _rows(model)["attn"] == (policy.split("_")[1], "")
        assert np.isfinite(losses).all()
    finally:
        tfmp.disable()


def test_plain_keras_audit_and_check_numerics_name_the_layer_and_the_constant():
    """The -1e9 model under plain Keras: `tfmp.audit` warns naming the layer, the constant and the
    fix; `tfmp.check_numerics` stops at that layer with the same cause."""
    model = _plain("mixed_float16", lambda: _attention_model(-1e9))
    [warning] = [w for w in tfmp.audit(model).warnings if w.kind == "sensitive_16bit"]
    assert warning.path == "attn"
    assert "its constant -1e+09 is beyond float16's largest value (6.55e+04)" in warning.message
    assert "tfmp.register_float32('attn')" in warning.message
    model.compile("sgd", "mse")
    with tfmp.check_numerics(model, phase="forward"):
        with pytest.raises(tfmp.NonFiniteError) as caught:
            model.fit(X6, Y6, epochs=1, verbose=0)
    assert caught.value.layer == "attn"
    assert "its constant -1e+09 is beyond float16's largest value" in str(caught.value)
    assert "\nFix: use a constant within +-6.55e+04 (e.g. -3e4), or tfmp.register_float32('attn').\nGuide: " \
        in str(caught.value)


def test_the_findings_keep_no_model_alive():
    """The findings are kept per layer, weakly: a model audited (traced twice) and dropped is collected,
    its attention layer too."""
    model = _plain("mixed_float16", lambda: _attention_model(-1e9))
    assert _rows(model)["attn"] == ("float16", "")
    assert any(w.path == "attn" for w in tfmp.audit(model).warnings)
    gone = [weakref.ref(model), weakref.ref(model.get_layer("attn"))]
    del model
    gc.collect()
    assert [ref() for ref in gone] == [None, None]


def test_the_float16_advice_names_the_ops_tensorflow_has_no_cpu_kernel_for():
    """The cause `tfmp.audit` and `tfmp.check_numerics` give for a float16 linalg layer, read against
    TensorFlow itself: each op run eagerly on a float16 3x3 matrix either has no CPU kernel
    (NotFoundError) or runs (then the advice says it is off, as measured above)."""
    matrix = tf.constant(np.eye(3) * 2.0 + 0.1, tf.float16)
    runs = {"Cholesky": tf.linalg.cholesky, "MatrixInverse": tf.linalg.inv, "Qr": tf.linalg.qr,
            "LogMatrixDeterminant": tf.linalg.slogdet}
    missing, running = [], []
    for name, op in runs.items():
        try:
            with tf.device("/CPU:0"):
                op(matrix)
            running.append(name)
        except tf.errors.NotFoundError:
            missing.append(name)
    advice = UnsafeOps("float16", tuple(sorted(runs))).advice("lin")
    cause, _, fix = advice.partition(". ")
    assert cause == (f"TensorFlow has no float16 CPU kernel for {', '.join(sorted(missing))}; "
                     f"its float16 {', '.join(sorted(running))} is about 10% off")
    assert fix == "Compute it in float32: tfmp.register_float32('lin') or tfmp.force_float32(model)."
