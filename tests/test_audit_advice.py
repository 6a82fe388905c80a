"""tfmp.audit's advice is true on models tfmp did not write: tied embeddings, what forcing costs, the fixes named.

The first part reproduces each case with plain Keras layers; the last part runs
keras-hub's own models (skipped where keras-hub is not installed).
"""

import keras
import numpy as np
import pytest

import tfmp
from tfmp._src.float32.logits import LOGITS_CAST

VOCAB, DIM, SEQ = 50, 8, 6
BODY = DIM * DIM + DIM  # the Dense between lookup and projection: kernel and bias
LOGITS_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture
def session():
    """Calls ``tfmp.enable(policy, **options)`` for the test; disables at its end."""
    yield tfmp.enable
    tfmp.disable()


def tied_lm(tie_weights=True):
    """A language model with Keras's tied input/output embedding, as keras-hub builds one."""
    embedding = keras.layers.ReversibleEmbedding(VOCAB, DIM, tie_weights=tie_weights, name="embedding")
    ids = keras.Input((SEQ,), dtype="int32")
    hidden = keras.layers.Dense(DIM, activation="relu", name="body")(embedding(ids))
    return keras.Model(ids, embedding(hidden, reverse=True))


class TiedLogits(keras.layers.Layer):
    """A tied output written by hand: the input Embedding's table reused for the logits."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))


def hand_tied_lm():
    embedding = keras.layers.Embedding(VOCAB, DIM, name="embedding")
    ids = keras.Input((SEQ,), dtype="int32")
    hidden = keras.layers.Dense(DIM, name="body")(embedding(ids))
    return keras.Model(ids, TiedLogits(embedding, name="tied_logits")(hidden))


def token_ids(seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (4, SEQ)).astype("int32")


def heavy_message(report):
    [message] = [w.message for w in report.warnings if w.kind == "float32_heavy"]
    return message


# A tied embedding: its lookup feeds the 16-bit body, its projection is float32 unless reverse_dtype says.

def projection_advice(low):
    return (f"set reverse_dtype='{low}' on it (layer.reverse_dtype = '{low}' before compiling, or "
            f"keras.layers.ReversibleEmbedding(..., reverse_dtype='{low}')) and compile the model with a "
            "cross-entropy loss object built with from_logits=True (e.g. "
            "loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)) while tfmp is enabled, "
            f"without calling tfmp.force_float32 first: the matmul then runs in {low} and tfmp casts the "
            "logits to float32.")


def compiled_tied_lm(reverse_dtype=None):
    model = tied_lm()
    model.get_layer("embedding").reverse_dtype = reverse_dtype
    model.compile("sgd", loss=LOGITS_LOSS)
    return model


def hidden_and_logits(model, ids):
    return keras.Model(model.inputs, model.get_layer("body").output)(ids), model(ids)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_tied_embedding_under_a_from_logits_loss_is_not_forced_and_its_float32_projection_is_counted(
        session, policy):
    low = policy[len("mixed_"):]
    keras.config.set_dtype_policy(policy)
    plain = tied_lm()  # plain Keras, the same weights
    session(policy)
    model = compiled_tied_lm()
    plain.set_weights(model.get_weights())
    embedding = model.get_layer("embedding")
    assert embedding.compute_dtype == low
    assert model.get_layer("body").input.dtype == low and model.outputs[0].dtype == "float32"
    ids = token_ids()
    hidden, logits = hidden_and_logits(model, ids)
    table = keras.ops.convert_to_tensor(embedding.embeddings)
    assert hidden.dtype == low and logits.dtype == "float32"
    # Keras's Embedding does not autocast its table inside a model: the matmul is promoted to float32.
    np.testing.assert_array_equal(logits, keras.ops.matmul(keras.ops.cast(hidden, "float32"),
                                                           keras.ops.transpose(table)))
    np.testing.assert_array_equal(logits, keras.ops.cast(plain(ids), "float32"))
    report = tfmp.audit(model, tensor_cores=False)
    row = next(r for r in report.rows if r.path == "embedding")
    assert (row.compute_dtype, row.forced) == (low, LOGITS_CAST)
    assert set(row.output_dtype.split(",")) == {low, "float32"}
    projection = VOCAB * DIM
    share = projection / (projection + BODY)
    assert report.float32_fraction == share
    assert [w.kind for w in report.warnings] == ["float32_heavy"]
    assert heavy_message(report).endswith(
        f"'embedding' (ReversibleEmbedding, {projection:,} parameters, {share:.0%}; float32: tied projection "
        "in float32 (Keras: table not autocast)): its output projection (reverse=True) is a float32 matmul, "
        f"{projection:,} multiply-adds per token (its lookup is a gather), forced or not: Keras's Embedding "
        "does not autocast its table inside a model, so the 16-bit hidden state is promoted to float32. "
        f"To change it: {projection_advice(low)}")


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_the_reverse_dtype_the_advice_names_makes_the_projection_16bit_with_float32_logits(session, policy):
    low = policy[len("mixed_"):]
    session(policy)
    model = compiled_tied_lm(reverse_dtype=low)
    ids = token_ids()
    hidden, logits = hidden_and_logits(model, ids)
    table = keras.ops.convert_to_tensor(model.get_layer("embedding").embeddings)
    in_low = keras.ops.matmul(hidden, keras.ops.transpose(keras.ops.cast(table, low)))
    assert in_low.dtype == low and logits.dtype == "float32"
    np.testing.assert_array_equal(logits, keras.ops.cast(in_low, "float32"))
    report = tfmp.audit(model, tensor_cores=False)
    assert report.float32_fraction == 0.0 and report.warnings == ()
    history = model.fit(ids, token_ids(1), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_a_tied_embedding_forced_whole_hands_its_lookup_back_in_16_bits():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = tfmp.force_float32(tied_lm())  # no loss known: the output layer is forced whole
    embedding = model.get_layer("embedding")
    assert embedding.compute_dtype == "float32"
    assert model.get_layer("body").input.dtype == "bfloat16" and model.outputs[0].dtype == "float32"
    ids = token_ids()
    looked_up = embedding(ids)
    table = np.asarray(embedding.embeddings)
    assert looked_up.dtype == "bfloat16"
    np.testing.assert_array_equal(keras.ops.cast(looked_up, "float32"),
                                  keras.ops.cast(keras.ops.cast(table[ids], "bfloat16"), "float32"))
    hidden = np.random.default_rng(2).normal(size=(4, SEQ, DIM)).astype("float32")
    projected = embedding(keras.ops.cast(hidden, "bfloat16"), reverse=True)
    assert projected.dtype == "float32"
    report = tfmp.audit(model, tensor_cores=False)
    assert "consumer_dtype" not in {w.kind for w in report.warnings}
    assert set(next(r for r in report.rows if r.path == "embedding").output_dtype.split(",")) == {
        "bfloat16", "float32"}


@pytest.mark.parametrize("tie_weights", [True, False])
def test_float32_heavy_counts_the_projection_once_and_names_the_layer_and_the_call(tie_weights):
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = tfmp.force_float32(tied_lm(tie_weights))
    report = tfmp.audit(model, tensor_cores=False)
    projection = VOCAB * DIM  # untied: reverse_embeddings (DIM x VOCAB); the lookup table is not multiplied
    own = VOCAB * DIM * (1 if tie_weights else 2)
    assert model.get_layer("embedding").count_params() == own
    assert report.float32_fraction == projection / (projection + BODY)
    share = f"{projection / (projection + BODY):.0%}"
    of = "" if tie_weights else f" of its {own:,}"
    assert heavy_message(report) == (
        f"{share} of the parameters the model multiplies per example (embedding lookups not counted) "
        "are multiplied in float32, so mixed precision speeds up little. "
        f"'embedding' (ReversibleEmbedding, {projection:,} parameters{of}, {share}; float32: output): "
        f"its output projection (reverse=True) is a float32 matmul, {projection:,} multiply-adds per "
        "token (its lookup is a gather), forced or not: Keras's Embedding does not autocast its table "
        "inside a model, so the 16-bit hidden state is promoted to float32. "
        f"To change it: {projection_advice('bfloat16')}")


def test_an_embedding_that_is_only_looked_up_costs_nothing_when_forced(session):
    session("mixed_bfloat16", keep_float32=["lookup"])
    ids = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(1000, DIM, name="lookup")(ids))
    model = keras.Model(ids, keras.layers.Dense(4, name="head")(x))
    model.compile("sgd", loss=LOGITS_LOSS)
    assert model.get_layer("lookup").compute_dtype == "float32"
    report = tfmp.audit(model, tensor_cores=False)
    assert report.float32_fraction == 0.0  # a gather; the head is cast only
    assert "float32_heavy" not in {w.kind for w in report.warnings}


def test_a_tied_output_written_by_hand_is_charged_the_table_it_multiplies():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = tfmp.force_float32(hand_tied_lm())
    logits_layer = model.get_layer("tied_logits")
    assert logits_layer.compute_dtype == "bfloat16" and model.outputs[0].dtype == "float32"  # body 16-bit
    assert tfmp.audit(model, tensor_cores=False).float32_fraction == 0.0
    forced = tfmp.force_float32(hand_tied_lm(), keep=["tied_logits"])
    assert forced.get_layer("tied_logits").compute_dtype == "float32"
    report = tfmp.audit(forced, tensor_cores=False)
    assert report.float32_fraction == VOCAB * DIM / (VOCAB * DIM + BODY)
    message = heavy_message(report)
    assert f"'tied_logits' (TiedLogits, {VOCAB * DIM:,} parameters of the Embedding it holds, " in message
    assert ("to compute it in bfloat16 anyway: tfmp.enable('mixed_bfloat16', exclude_float32=['tied_logits']) "
            "before compiling, or tfmp.force_float32(model, exclude=['tied_logits'])") in message
    again = tfmp.force_float32(hand_tied_lm(), keep=["tied_logits"], exclude=["tied_logits"])
    assert again.get_layer("tied_logits").compute_dtype == "bfloat16"  # the call named does it


# Each advice names a change, and the change does what it says.

def wide(activation=None, split=False):
    inputs = keras.Input((64,))
    x = keras.layers.Dense(256, activation=activation, name="gate")(inputs)
    if split:
        x = keras.layers.Activation("softmax", name="gate_softmax")(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(x))


def test_a_fused_softmax_is_named_with_the_split_that_frees_its_matmul():
    keras.config.set_dtype_policy("mixed_float16")
    report = tfmp.audit(tfmp.force_float32(wide("softmax")), tensor_cores=False)
    gate, out = 64 * 256 + 256, 256 * 2 + 2
    assert report.float32_fraction == 1.0
    assert (f"'gate' (Dense, {gate:,} parameters, {gate / (gate + out):.0%}; float32: fused softmax): its "
            f"{gate:,} parameters are multiplied in float32 at every position it is applied to. To change "
            "it: only its fused softmax needs float32: build it with activation=None followed by "
            "keras.layers.Activation('softmax'), and tfmp forces only the activation.") in heavy_message(report)
    split = tfmp.audit(tfmp.force_float32(wide(split=True)), tensor_cores=False)
    assert split.float32_fraction == out / (gate + out)
    assert "float32_heavy" not in {w.kind for w in split.warnings}


def test_a_keep_rule_is_named_as_the_cause_and_dropping_it_frees_the_layer():
    keras.config.set_dtype_policy("mixed_float16")
    report = tfmp.audit(tfmp.force_float32(wide(), keep=["gate"]), tensor_cores=False)
    assert ("float32: user rule): its 16,640 parameters are multiplied in float32 at every position it is "
            "applied to. To change it: a keep rule selected it: remove the class or pattern matching 'gate' "
            "from keep_float32= (tfmp.enable), keep= (tfmp.force_float32) or tfmp.register_float32 "
            "(tfmp.unregister_float32).") in heavy_message(report)
    assert tfmp.force_float32(wide()).get_layer("gate").compute_dtype == "float16"


def test_the_output_advice_names_the_exclusion_that_keeps_it_16bit(session):
    session("mixed_bfloat16", exclude_float32=["out"])
    model = wide()
    model.compile("sgd", loss="mse")
    [message] = [w.message for w in tfmp.audit(model, tensor_cores=False).warnings if w.kind == "output_16bit"]
    assert message == (
        "'out' produces a model output in bfloat16; outputs (and the loss) should be float32. An exclusion "
        "keeps it out of float32: remove the target matching 'out' from exclude_float32= (tfmp.enable), "
        "exclude= (tfmp.force_float32) or tfmp.register_float32(..., exclude=True) (tfmp.unregister_float32).")
    tfmp.disable()
    session("mixed_bfloat16")
    model = wide()
    model.compile("sgd", loss="mse")
    assert model.get_layer("out").compute_dtype == "float32"


def test_unforced_warnings_name_the_calls_that_force_and_those_calls_clear_them():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Softmax(name="probs")(keras.layers.Dense(4, name="d")(inputs)))
    messages = {w.kind: w.message for w in tfmp.audit(model, tensor_cores=False).warnings}
    assert messages == {
        "sensitive_16bit": ("'probs' (Softmax) computes in bfloat16; Compiling the model while tfmp is enabled, "
                            "or tfmp.force_float32(model), computes it in float32."),
        "output_16bit": ("'probs' produces a model output in bfloat16; outputs (and the loss) should be float32. "
                         "Compiling the model while tfmp is enabled, or tfmp.force_float32(model), makes its "
                         "output float32."),
    }
    assert tfmp.audit(tfmp.force_float32(model), tensor_cores=False).warnings == ()


def test_pure_16bit_weights_name_the_mixed_policy_and_it_clears_them():
    keras.config.set_dtype_policy("mixed_bfloat16")

    def model(dtype):
        inputs = keras.Input((16,))
        x = keras.layers.Dense(16, dtype=dtype, name="d")(inputs)
        return tfmp.force_float32(keras.Model(inputs, keras.layers.Dense(4, name="out")(x)))

    [message] = [w.message for w in tfmp.audit(model("bfloat16"), tensor_cores=False).warnings
                 if w.kind == "variables_16bit"]
    assert message.endswith("Build it under a mixed policy: tfmp.enable('mixed_bfloat16') before building "
                            "the model, or dtype='mixed_bfloat16' on the layer.")
    assert tfmp.audit(model("mixed_bfloat16"), tensor_cores=False).warnings == ()


def test_tensor_core_advice_names_the_next_multiple_of_8_and_it_clears_the_warning():
    keras.config.set_dtype_policy("mixed_float16")

    def model(units):
        inputs = keras.Input((16,))
        return tfmp.force_float32(keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(units, name="d")(inputs))))

    messages = [w.message for w in tfmp.audit(model(30), tensor_cores=True, batch_size=12).warnings]
    assert messages == [
        "'d' has units 30, not a multiple of 8; Tensor Cores need multiples of 8 in 16 bits "
        "(NVIDIA mixed-precision guide): use e.g. 32.",
        "batch size 12 is not a multiple of 8; Tensor Cores need multiples of 8 in 16 bits: use e.g. 16.",
    ]
    assert tfmp.audit(model(32), tensor_cores=True, batch_size=16).warnings == ()


class Mix(keras.layers.Layer):
    def call(self, x):
        return x * 2.0


def test_the_consumer_advice_names_keep_float32_and_it_clears_the_cast(session):
    def model():
        inputs = keras.Input((8,))
        aux = keras.layers.Dense(8, name="aux")(inputs)
        return keras.Model(inputs, [aux, keras.layers.Dense(8, name="main")(Mix(name="mix")(aux))])

    session("mixed_bfloat16")
    plain = model()
    plain.compile("sgd", loss="mse")
    [message] = [w.message for w in tfmp.audit(plain, tensor_cores=False).warnings if w.kind == "consumer_dtype"]
    assert message == (
        "'aux' (float32: output) hands float32 to 'mix', which computes in bfloat16: the value is cast at "
        "that boundary. Nothing to change unless 'mix' needs it in float32: then keep_float32=['mix'] in "
        "tfmp.enable() (keep=['mix'] in tfmp.force_float32).")
    tfmp.disable()
    session("mixed_bfloat16", keep_float32=["mix"])
    kept = model()
    kept.compile("sgd", loss="mse")
    assert kept.get_layer("mix").compute_dtype == "float32"
    # 'mix' now takes aux's float32 (and, forced, hands its parent's bfloat16 on to 'main')
    assert [w.path for w in tfmp.audit(kept, tensor_cores=False).warnings if w.kind == "consumer_dtype"] == ["mix"]


# keras-hub's models, built small from their configs (no download).

HUB_VOCAB = 1000  # the LMs' tied projection then outweighs their 2-layer body, as in small LMs


def hub_models():
    hub = pytest.importorskip("keras_hub")
    m = hub.models
    llama = dict(vocabulary_size=HUB_VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
                 hidden_dim=32, intermediate_dim=64)
    encoder = dict(vocabulary_size=HUB_VOCAB, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
                   max_sequence_length=32)
    return {
        "llama": lambda: m.LlamaBackbone(**llama),
        "gemma": lambda: m.GemmaBackbone(**llama, head_dim=16),
        "deberta": lambda: m.DebertaV3Backbone(**encoder, bucket_size=8),
        "gpt2": lambda: m.GPT2Backbone(**encoder),
        "bert": lambda: m.BertBackbone(**encoder),
        "llama_lm": lambda: m.LlamaCausalLM(backbone=m.LlamaBackbone(**llama), preprocessor=None),
        "gemma_lm": lambda: m.GemmaCausalLM(backbone=m.GemmaBackbone(**llama, head_dim=16), preprocessor=None),
        "gpt2_lm": lambda: m.GPT2CausalLM(backbone=m.GPT2Backbone(**encoder), preprocessor=None),
        "bert_classifier": lambda: m.BertTextClassifier(backbone=m.BertBackbone(**encoder), num_classes=3,
                                                        preprocessor=None),
        "deberta_classifier": lambda: m.DebertaV3TextClassifier(
            backbone=m.DebertaV3Backbone(**encoder, bucket_size=8), num_classes=3, preprocessor=None),
    }


HUB = ["llama", "gemma", "deberta", "gpt2", "bert", "llama_lm", "gemma_lm", "gpt2_lm",
       "bert_classifier", "deberta_classifier"]


def projection_share(model):
    """The LM's tied projection over what it multiplies: all parameters but an untied lookup table."""
    embedding = model.backbone.token_embedding
    projection = HUB_VOCAB * model.backbone.hidden_dim
    return projection, projection / (model.count_params() - (0 if embedding.tie_weights else projection))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("name", HUB)
def test_keras_hub_models_compiled_under_tfmp_get_only_true_warnings(session, name, policy):
    low = policy[len("mixed_") :]
    build = hub_models()[name]
    session(policy)
    model = build()
    model.compile()  # the task's own defaults: a from-logits cross-entropy for LMs and classifiers
    report = tfmp.audit(model, tensor_cores=False)
    pinned = [r for r in report.rows if r.compute_dtype == "float32" and not r.forced]
    if name.startswith(("llama", "gemma")):  # keras-hub pins their attention softmax: not a mismatch
        assert pinned and all(r.class_name == "Softmax" for r in pinned)
    if not name.endswith("_lm"):
        assert report.warnings == (), [w.message for w in report.warnings]
        return
    [row] = [r for r in report.rows if r.path.endswith("/token_embedding")]
    assert (row.compute_dtype, row.forced) == (low, LOGITS_CAST)
    projection, share = projection_share(model)
    assert report.float32_fraction == share
    assert [w.kind for w in report.warnings] == ["float32_heavy"]
    message = heavy_message(report)
    assert f"'{row.path}' (ReversibleEmbedding, {projection:,} parameters" in message
    assert message.endswith(f"To change it: {projection_advice(low)}")
    # What the advice says, done: the projection in 16 bits, float32 logits, nothing left to warn about.
    model = build()
    model.backbone.token_embedding.reverse_dtype = low
    model.compile()
    report = tfmp.audit(model, tensor_cores=False)
    assert report.float32_fraction == 0.0 and report.warnings == ()
    ids = np.random.default_rng(0).integers(1, HUB_VOCAB, (2, 8)).astype("int32")
    inputs = {"token_ids": ids, "padding_mask": np.ones((2, 8), bool)}
    assert model(inputs).dtype == "float32"
    assert np.isfinite(model.fit(inputs, ids, epochs=1, verbose=0).history["loss"][0])


@pytest.mark.parametrize("name", ["llama", "gemma", "gpt2", "bert"])
def test_keras_hub_backbones_not_compiled_get_only_true_warnings(session, name):
    build = hub_models()[name]
    session("mixed_bfloat16")
    backbone = build()
    report = tfmp.audit(backbone, tensor_cores=False)
    assert {w.kind for w in report.warnings} <= {"sensitive_16bit", "output_16bit"}
    for w in report.warnings:  # true: the layer named computes in bfloat16 now
        assert next(r for r in report.rows if r.path == w.path).compute_dtype == "bfloat16"
    assert tfmp.audit(tfmp.force_float32(backbone), tensor_cores=False).warnings == ()  # the call named


@pytest.mark.parametrize("name", ["llama_lm", "gemma_lm"])  # untied, tied
def test_keras_hub_lm_forced_by_hand_names_its_token_embedding_with_the_parameters_it_multiplies(name):
    build = hub_models()[name]
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = tfmp.force_float32(build())
    report = tfmp.audit(model, tensor_cores=False)
    projection, share = projection_share(model)
    assert report.float32_fraction == share
    [path] = [r.path for r in report.rows if r.path.endswith("/token_embedding")]
    message = heavy_message(report)
    assert f"'{path}' (ReversibleEmbedding, {projection:,} parameters" in message
    assert message.endswith(f"To change it: {projection_advice('bfloat16')}")


@pytest.mark.parametrize("activation, loss, advised", [
    ("softmax", "sparse_categorical_crossentropy", "SparseCategoricalCrossentropy(from_logits=True)"),
    ("sigmoid", "binary_crossentropy", "BinaryCrossentropy(from_logits=True)"),
])
def test_a_softmax_or_sigmoid_head_is_told_to_move_its_activation_into_the_loss(session, activation, loss,
                                                                                 advised):
    """A wide head with a fused softmax/sigmoid: the advice names the from-logits loss, and following it
    keeps the head's matmul 16-bit with float32 logits, which clears the warning."""

    def wide_head(head_activation):
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, name="body"),
                                 keras.layers.Dense(4096, activation=head_activation, name="head")])

    session("mixed_bfloat16")
    model = wide_head(activation)
    model.compile("sgd", loss=loss)
    message = heavy_message(tfmp.audit(model, tensor_cores=False))
    # head: 16 * 4096 + 4096 parameters, body 16 * 16 + 16: the head's share, from the shapes
    share = (16 * 4096 + 4096) / (16 * 4096 + 4096 + 16 * 16 + 16)
    assert f"{share:.0%}" in message and "'head'" in message
    assert f"build it with activation=None and compile with loss=keras.losses.{advised}" in message
    followed = wide_head(None)
    followed.compile("sgd", loss=getattr(keras.losses, advised.split("(")[0])(from_logits=True))
    report = tfmp.audit(followed, tensor_cores=False)
    assert [w for w in report.warnings if w.kind == "float32_heavy"] == []
    assert followed.get_layer("head").compute_dtype == "bfloat16"
    assert followed(np.ones((2, 16), "float32")).dtype == "float32"
