"""Public mixed-precision bug reports on float16 reductions whose sum can exceed 65504.

One test per kind, citing its report: plain Keras under mixed_float16 gives inf
(shown first, so the case stays a real one), tfmp gives float32's value within
float16's rounding; `tfmp.audit` shows the rule's reason and, for a layer left in
float16, the cause and the fix; `tfmp.check_numerics` names the layer with them.
The last tests pin the rule's edges (`tfmp/_src/float32/reductions.py`).

Expected values are written down from arithmetic, not computed by tfmp:
logsumexp of N copies of c is ``c + log N``; float16 holds at most 65504 and
rounds values in [8, 16) to steps of 2**-7, so a result handed back in float16
is within 2**-8 of float32's.
"""

import gc
import math
import weakref

import keras
import numpy as np
import pytest

import tfmp

WIDE = 76_800  # google-research/last#43: a log-semiring reduction this wide is inf in float16
#: Rows of constant log weights 0 and -3: logsumexp is log(76,800) and log(76,800) - 3.
ROWS = np.stack([np.zeros(WIDE), np.full(WIDE, -3.0)]).astype("float32")
EXPECTED = np.array([[11.248959919135764], [8.248959919135764]])  # log(76800) = 11.24896
#: Half a float16 step in [8, 16): 2**-8.
FLOAT16_HALF_STEP = 2.0**-8


def _logsumexp_model():
    """The reduction inside (a ``Lambda``), an identity ``Dense`` head after it."""
    inputs = keras.Input((WIDE,))
    lse = keras.layers.Lambda(lambda x: keras.ops.logsumexp(x, axis=-1, keepdims=True), name="lse")
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(lse(inputs)))


class LogSumExpBlock(keras.layers.Layer):
    """A custom block: a Dense projection, and a raw log(sum(exp(x))) in its own code."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(1, name="proj")

    def call(self, x):
        return self.proj(x) + keras.ops.log(keras.ops.sum(keras.ops.exp(x), axis=-1, keepdims=True))


def _block_model():
    inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(LogSumExpBlock(name="block")(inputs)))


class WrapsLogSumExp(keras.layers.Layer):
    """A block whose wide reduction sits in a Lambda sublayer (no graph call of its own)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(1, name="proj")
        self.lse = keras.layers.Lambda(lambda x: keras.ops.logsumexp(x, axis=-1, keepdims=True), name="lse")

    def call(self, x):
        return self.proj(x) + self.lse(x)


def _wrapped_model():
    inputs = keras.Input((WIDE,))
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(WrapsLogSumExp(name="block")(inputs)))


IDENTITY_HEAD = [np.ones((1, 1), "float32"), np.zeros(1, "float32")]


def _plain(policy, build):
    """`build()` under plain Keras and `policy` (restored by conftest)."""
    keras.config.set_dtype_policy(policy)
    model = build()
    keras.config.set_dtype_policy("float32")
    return model


def _row(model, path):
    [row] = [r for r in tfmp.audit(model).rows if r.path == path]
    return row


def test_logsumexp_over_76800_float16_values_is_finite_google_research_last_43():
    """google-research/last#43: a float16 logsumexp over 65,536+ values is inf
    (the shifted exponentials are at most 1, their sum reaches the count); tfmp
    forces the layer and gets log(76,800) = 11.249 and log(76,800) - 3."""
    plain = _plain("mixed_float16", _logsumexp_model)
    plain.set_weights(IDENTITY_HEAD)
    assert np.isinf(plain.predict(ROWS, verbose=0)).all()  # the report's failure, plain Keras
    try:
        with tfmp.policy_scope("mixed_float16"):
            model = _logsumexp_model()
            model.compile("sgd", "mse")
        model.set_weights(IDENTITY_HEAD)
        got = model.predict(ROWS, verbose=0)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, EXPECTED, rtol=0, atol=FLOAT16_HALF_STEP)
        row = _row(model, "lse")
        assert (row.compute_dtype, row.why) == ("float32", "float16 reduction: logsumexp over 76,800 values")
        assert _row(model, "head").why == "output"
    finally:
        tfmp.disable()


def test_audit_of_plain_keras_says_the_cause_and_the_fix_google_research_last_43():
    """The same model under plain Keras: `tfmp.audit` warns with the reduction, its
    width, the float16 maximum and the fixes, naming the layer's path."""
    report = tfmp.audit(_plain("mixed_float16", _logsumexp_model))
    [warning] = [w for w in report.warnings if w.path == "lse"]
    assert warning.kind == "sensitive_16bit"
    assert warning.message == (
        "'lse' (Lambda) computes in float16; its float16 logsumexp over 76,800 values can "
        "exceed 65504, the float16 maximum (summing 76,800 values of magnitude 1 gives 76,800). "
        "Compute it in float32: tfmp.force_float32(model) (the layer not excluded) or "
        "tfmp.register_float32('lse'), or cast its input to float32 before reducing.")
    assert _row(tfmp.force_float32(_plain("mixed_float16", _logsumexp_model)), "lse").compute_dtype == "float32"


@pytest.mark.parametrize("where", ["lse", "block/lse"])
def test_check_numerics_names_the_reduction_layer_google_research_last_43(where):
    """Training the plain Keras model: `tfmp.check_numerics` stops at the first layer to
    go inf, the reduction (a graph layer, or a Lambda inside a custom block), and says
    why and what to do."""
    model = _plain("mixed_float16", _logsumexp_model if where == "lse" else _wrapped_model)
    model.compile("sgd", "mse")
    with tfmp.check_numerics(model, phase="forward"):
        with pytest.raises(tfmp.NonFiniteError) as caught:
            model.fit(ROWS[:1], np.zeros((1, 1)), epochs=1, verbose=0)
    error = caught.value
    assert (error.layer, error.phase, error.kind) == (where, "forward", "inf")
    assert "The likely cause: its float16 logsumexp over 76,800 values can exceed 65504" in str(error)
    assert f"tfmp.register_float32('{where}')" in str(error)


def test_unshifted_sum_of_exp_in_a_custom_block_is_forced_whole():
    """A raw log(sum(exp(x))) in a custom block's own code: exp(12) = 162,755 is inf in
    float16 before any sum; tfmp forces the block (reason "sum of exp") and gets
    float32's value. Its Dense sublayer's ops are its own, not the reduction."""
    x = np.array([[4, 5, 6, 7, 8, 9, 10, 12]], "float32")
    expected = math.log(sum(math.exp(v) for v in x[0]))  # 12.3839, from arithmetic
    weights = [np.zeros((8, 1), "float32"), np.zeros(1, "float32")] + IDENTITY_HEAD  # proj(x) = 0
    plain = _plain("mixed_float16", _block_model)
    plain.set_weights(weights)
    assert np.isinf(plain.predict(x, verbose=0)).all()
    try:
        with tfmp.policy_scope("mixed_float16"):
            model = _block_model()
            model.compile("sgd", "mse")
        model.set_weights(weights)
        np.testing.assert_allclose(model.predict(x, verbose=0), [[expected]], rtol=0, atol=FLOAT16_HALF_STEP)
        assert _row(model, "block").why == "float16 reduction: sum of exp over 8 values"
        assert _row(model, "block/proj").why == "inside block"
    finally:
        tfmp.disable()


@pytest.mark.parametrize("policy, forced", [("mixed_float16", True), ("mixed_bfloat16", False)])
def test_the_rule_finds_the_sublayer_and_leaves_bfloat16_alone(policy, forced):
    """The reduction belongs to the sublayer that makes it: the Lambda inside the block
    is forced, the block and its Dense keep the 16-bit policy. Under bfloat16
    (largest value about 3.4e38) nothing overflows: nothing is forced."""
    try:
        with tfmp.policy_scope(policy):
            model = _wrapped_model()
            model.compile("sgd", "mse")
        low = policy.split("_")[1]
        rows = {r.path: (r.compute_dtype, r.why) for r in tfmp.audit(model).rows}
        lse = ("float32", "float16 reduction: logsumexp over 76,800 values") if forced else (low, "")
        assert rows == {"block": (low, ""), "block/proj": (low, ""), "block/lse": lse,
                        "head": ("float32", "output")}
    finally:
        tfmp.disable()


@pytest.mark.parametrize("width, why", [(65504, ""), (65505, "float16 reduction: sum over 65,505 values")])
def test_a_sum_is_flagged_past_65504_values_and_keras_mean_never(width, why):
    """A float16 sum of `width` values of magnitude 1 reaches `width`: 65,504 is the
    float16 maximum, 65,505 is past it. `keras.ops.mean` over 76,800 values is never
    flagged: Keras casts to float32 before reducing."""
    def build():
        inputs = keras.Input((WIDE,))
        total = keras.layers.Lambda(lambda x: keras.ops.sum(x[:, :width], axis=-1, keepdims=True), name="sum")
        mean = keras.layers.Lambda(lambda x: keras.ops.mean(x, axis=-1, keepdims=True), name="mean")
        return keras.Model(inputs, keras.layers.Dense(1, name="head")(keras.ops.add(total(inputs), mean(inputs))))

    model = _plain("mixed_float16", build)
    assert {layer.compute_dtype for layer in model.layers[1:]} == {"float16"}
    report = tfmp.audit(model)
    assert [w.path for w in report.warnings if w.kind == "sensitive_16bit"] == (["sum"] if why else [])
    tfmp.force_float32(model)
    assert [(r.path, r.why) for r in tfmp.audit(model).rows if r.path in ("sum", "mean")] == [
        ("sum", why), ("mean", "")]


def test_the_trace_keeps_no_model_alive():
    """The findings are kept per layer, weakly: a model audited and dropped is collected."""
    model = _plain("mixed_float16", _logsumexp_model)
    assert _row(model, "lse").warnings == ("sensitive_16bit",)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
