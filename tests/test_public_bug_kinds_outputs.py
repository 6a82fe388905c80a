"""Public bug kinds: a custom block producing a model output computes in 16 bits.

The keras.io miniature GPT ("Text generation with a miniature GPT") returns
``[logits, x]``, ``x`` the output of its ``TransformerBlock``. Forcing that block
to float32 because it produces an output ran its whole body (attention, FFN) in
float32: its loss equalled float32's exactly and mixed precision bought nothing.
The rule: the model's outputs are float32, not the computation producing them. The
block keeps its 16-bit policy, its sublayers follow the float32 rules (the
attention's softmax forced, its Dense layers 16-bit), and its output is cast to
float32. A leaf output layer (the logits Dense) still computes in float32.

Sizes are tiny (vocabulary 40, 8 tokens, 16 features): the cases check dtypes and
values, not speed.
"""

import types

import keras
import numpy as np
import pytest
from keras import layers, ops

import tfmp
from tfmp._src.float32.registry import OUTPUT_CAST

pytestmark = pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")  # bfloat16 emulated on CPUs

VOCAB, MAXLEN, EMBED, HEADS, FFN = 40, 8, 16, 2, 32


class TransformerBlock(layers.Layer):
    """keras.io miniature GPT's block: causal self-attention, then a Dense FFN, each with a residual and a LayerNormalization."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(HEADS, EMBED, name="att")
        self.ffn = keras.Sequential(
            [layers.Dense(FFN, activation="relu", name="ffn_in"), layers.Dense(EMBED, name="ffn_out")],
            name="ffn")
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6, name="norm1")
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6, name="norm2")

    def call(self, inputs):
        steps = ops.shape(inputs)[1]
        causal = ops.cast(ops.arange(steps)[:, None] >= ops.arange(steps)[None, :], "int32")
        attention_output = self.att(inputs, inputs, attention_mask=causal[None])
        out1 = self.layernorm1(inputs + attention_output)
        return self.layernorm2(out1 + self.ffn(out1))


class TokenAndPositionEmbedding(layers.Layer):
    """keras.io miniature GPT's embedding: token embedding plus position embedding."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(VOCAB, EMBED)
        self.pos_emb = layers.Embedding(MAXLEN, EMBED)

    def call(self, x):
        return self.token_emb(x) + self.pos_emb(ops.arange(ops.shape(x)[-1]))


class ShapedBlock(TransformerBlock):
    """The same block declaring its output shape: Keras then builds its symbolic output
    from ``compute_output_shape`` and the layer's compute dtype, without tracing ``call``."""

    def compute_output_shape(self, input_shape):
        return input_shape


def _gpt(block=TransformerBlock):
    inputs = layers.Input((MAXLEN,), dtype="int32")
    x = TokenAndPositionEmbedding(name="embed")(inputs)
    x = block(name="block")(x)
    return keras.Model(inputs, [layers.Dense(VOCAB, name="logits")(x), x])


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _tfmp_gpt(weights, block=TransformerBlock):
    """The GPT built and compiled under tfmp's "mixed_bfloat16" (loss on the logits only, as keras.io)."""
    with tfmp.policy_scope("mixed_bfloat16"):
        model = _gpt(block)
        model.compile(keras.optimizers.Adam(1e-2), loss=[_loss(), None])
    model.set_weights(weights)
    return model


@pytest.fixture(scope="module")
def gpt():
    """float32 reference, plain Keras mixed_bfloat16 and tfmp models with the same weights, and their predictions.

    The models are let go at the module's end: the module's last test still holds
    the fixture while the module-end check (conftest.py) looks for live attached models.
    """
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(16, MAXLEN)).astype("int32")
    keras.utils.set_random_seed(0)
    reference = _gpt()
    weights = reference.get_weights()
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        plain = _gpt()
    finally:
        keras.config.set_dtype_policy(before)
    plain.set_weights(weights)
    model = _tfmp_gpt(weights)
    case = types.SimpleNamespace(
        tokens=tokens, targets=np.roll(tokens, -1, axis=1), weights=weights,
        expected=reference.predict(tokens, verbose=0), plain=plain,
        plain_out=plain.predict(tokens, verbose=0), model=model,
        got=model.predict(tokens, verbose=0))
    yield case
    vars(case).clear()


def test_miniature_gpt_outputs_are_float32_keras_io_gpt(gpt):
    """keras.io miniature GPT: plain Keras mixed_bfloat16 returns both outputs in
    bfloat16; under tfmp both are float32, in the symbolic graph and at run time."""
    assert [t.dtype for t in gpt.plain.outputs] == ["bfloat16", "bfloat16"]
    assert [np.dtype(a.dtype).name for a in gpt.plain_out] == ["bfloat16", "bfloat16"]
    assert [t.dtype for t in gpt.model.outputs] == ["float32", "float32"]
    assert [a.dtype for a in gpt.got] == [np.float32, np.float32]


def test_miniature_gpt_block_body_computes_in_bfloat16_keras_io_gpt(gpt):
    """keras.io miniature GPT: the block producing an output keeps its 16-bit policy.
    Its output equals plain Keras's 16-bit block output exactly (cast to float32):
    the body computed as under plain Keras, not in float32."""
    np.testing.assert_array_equal(gpt.got[1], gpt.plain_out[1].astype("float32"))
    assert not np.array_equal(gpt.got[1], gpt.expected[1])  # float32's body differs


def test_miniature_gpt_audit_shows_16bit_sublayers_and_the_cast_keras_io_gpt(gpt):
    """keras.io miniature GPT: `tfmp.audit` (with a batch: measured output dtypes)
    shows the block 16-bit with its output cast, its attention projections and FFN
    Dense layers 16-bit, the attention's softmax forced, the logits Dense 16-bit
    with its output cast (its loss is a from-logits cross-entropy)."""
    report = tfmp.audit(gpt.model, batch=gpt.tokens)
    rows = {row.path: row for row in report.rows}
    got = {path: (rows[path].compute_dtype, rows[path].output_dtype, rows[path].why) for path in (
        "block", "block/att/query", "block/att/key", "block/att/value", "block/att/attention_output",
        "block/ffn/ffn_in", "block/ffn/ffn_out", "logits")}
    assert got == {
        "block": ("bfloat16", "float32", "output cast to float32 (body 16-bit)"),
        "block/att/query": ("bfloat16", "bfloat16", ""),
        "block/att/key": ("bfloat16", "bfloat16", ""),
        "block/att/value": ("bfloat16", "bfloat16", ""),
        "block/att/attention_output": ("bfloat16", "bfloat16", ""),
        "block/ffn/ffn_in": ("bfloat16", "bfloat16", ""),
        "block/ffn/ffn_out": ("bfloat16", "bfloat16", ""),
        "logits": ("bfloat16", "float32", "logits cast to float32 (16-bit matmul, float32 cross-entropy)"),
    }
    [softmax] = [row for row in report.rows if row.class_name == "Softmax"]
    assert (softmax.compute_dtype, softmax.why) == ("float32", "softmax")
    assert OUTPUT_CAST == "output cast to float32 (body 16-bit)"
    assert not [w for w in report.warnings if w.kind == "output_16bit"]


def _cross_entropy(logits, targets):
    """Mean sparse categorical cross-entropy of float64 `logits` (NumPy, log-sum-exp)."""
    logits = logits.astype("float64")
    top = logits.max(axis=-1, keepdims=True)
    log_sum = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
    return float(np.mean(log_sum - np.take_along_axis(logits, targets[..., None], -1)[..., 0]))


def test_miniature_gpt_loss_is_16bit_within_bfloat16_tolerance_keras_io_gpt(gpt):
    """keras.io miniature GPT: the logits under tfmp are plain Keras's 16-bit logits
    exactly, handed over in float32 (the vocabulary projection keeps its 16-bit
    matmul, as the Keras mixed-precision guide and PyTorch autocast run it), so
    the loss differs from float32's; it stays within bfloat16's tolerance: 2**-8
    (bfloat16's relative step) of the loss."""
    np.testing.assert_array_equal(gpt.got[0], gpt.plain_out[0].astype("float32"))
    got = float(_loss()(gpt.targets, gpt.got[0]))
    expected = _cross_entropy(gpt.expected[0], gpt.targets)
    assert abs(got - expected) > 1e-5  # not float32's loss
    assert abs(got - expected) <= 2**-8 * expected
    # The block output: a few bfloat16 roundings deep, 2**-6 of its scale bounds it.
    np.testing.assert_allclose(gpt.got[1], gpt.expected[1], rtol=0,
                               atol=2**-6 * np.abs(gpt.expected[1]).max())


def test_miniature_gpt_trains_keras_io_gpt(gpt):
    """keras.io miniature GPT under tfmp: five full-batch Adam steps on the logits'
    loss, every loss finite and each lower than the one before (lr 1e-2)."""
    model = _tfmp_gpt(gpt.weights)
    losses = model.fit(gpt.tokens, gpt.targets, batch_size=16, epochs=5, verbose=0).history["loss"]
    assert np.isfinite(losses).all()
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_a_16_bit_logits_head_is_kept_through_saving_and_loading_keras_io_gpt(gpt, tmp_path):
    """keras.io miniature GPT saved and loaded while enabled: the logits Dense keeps
    its 16-bit policy and float32 output (the saved loss is read again), and the
    loaded model predicts what the trained one does."""
    path = str(tmp_path / "gpt.keras")
    gpt.model.save(path)
    with tfmp.policy_scope("mixed_bfloat16"):
        loaded = keras.models.load_model(path, custom_objects={
            "TransformerBlock": TransformerBlock, "TokenAndPositionEmbedding": TokenAndPositionEmbedding})
    assert loaded.get_layer("logits").compute_dtype == "bfloat16"
    assert {row.path: row.why for row in tfmp.audit(loaded).rows}["logits"] == (
        "logits cast to float32 (16-bit matmul, float32 cross-entropy)")
    got = loaded.predict(gpt.tokens, verbose=0)
    assert [a.dtype for a in got] == [np.float32, np.float32]
    np.testing.assert_array_equal(got[0], gpt.got[0])


def test_block_declaring_its_output_shape_keeps_a_float32_symbolic_output_keras_io_gpt(gpt):
    """keras.io miniature GPT with a block that defines `compute_output_shape`: Keras
    builds its symbolic output in the block's own bfloat16; tfmp's cast shows float32
    there too, and the block still computes in bfloat16."""
    model = _tfmp_gpt(gpt.weights, ShapedBlock)
    assert [t.dtype for t in model.outputs] == ["float32", "float32"]
    assert model.get_layer("block").compute_dtype == "bfloat16"
    np.testing.assert_array_equal(model.predict(gpt.tokens, verbose=0)[1], gpt.got[1])


def test_leaf_and_keras_output_layers_and_selected_blocks_stay_float32_keras_io_gpt(gpt):
    """The rule changes blocks only: a Keras layer with sublayers producing an output
    (MultiHeadAttention) is one computation and is forced whole, as a final Dense
    is; a block a user rule selects (``keep=``) is forced whole too."""
    with tfmp.policy_scope("mixed_bfloat16"):
        inputs = layers.Input((MAXLEN, EMBED))
        attention = layers.MultiHeadAttention(HEADS, EMBED, name="att")
        model = keras.Model(inputs, attention(inputs, inputs))
        model.compile("sgd", "mse")
    assert (attention.compute_dtype, attention._query_dense.compute_dtype) == ("float32", "float32")
    assert tfmp.audit(model).rows[0].why == "output"
    # A final Dense stays float32 unless its loss is a from-logits cross-entropy object:
    # a regression loss, a loss given by name, a softmax head or a kept head.
    for loss, activation, keep in [("mse", None, ()), ("sparse_categorical_crossentropy", None, ()),
                                   (_loss(), "softmax", ()), (_loss(), None, ("head",))]:
        with tfmp.policy_scope("mixed_bfloat16", keep_float32=keep):
            inputs = layers.Input((EMBED,))
            head = layers.Dense(VOCAB, activation=activation, name="head")
            model = keras.Model(inputs, head(layers.Dense(EMBED)(inputs)))
            model.compile("sgd", loss)
        assert head.compute_dtype == "float32", (loss, activation, keep)
    with tfmp.policy_scope("mixed_bfloat16"):
        kept = _gpt()
    tfmp.force_float32(kept, keep=[TransformerBlock])
    block = kept.get_layer("block")
    assert (block.compute_dtype, block.ffn.layers[0].compute_dtype) == ("float32", "float32")
    assert [t.dtype for t in kept.outputs] == ["float32", "float32"]
    assert {row.path: row.why for row in tfmp.audit(kept).rows}["block"] == "output"
