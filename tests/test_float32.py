"""Tests for tfmp.force_float32 and the float32 registry (tfmp/_float32.py, _registry.py)."""

import warnings

import keras
import numpy as np
import pytest
from _collect import collect_everything

import tfmp
from tfmp._src.keras_hooks.versions import keras_at_least
from tfmp._src.float32 import registry as _registry
from tfmp._src.keras_hooks import patches

MIXED = ["mixed_float16", "mixed_bfloat16"]
LOW = ("float16", "bfloat16")


@pytest.fixture(autouse=True)
def clean_registry():
    """Each test starts and ends with an empty user registry."""
    saved = (list(_registry._keep), list(_registry._exclude))
    _registry._keep.clear()
    _registry._exclude.clear()
    yield
    _registry._keep[:], _registry._exclude[:] = saved


def _normalization_layers():
    layers = [
        keras.layers.BatchNormalization(),
        keras.layers.LayerNormalization(),
        keras.layers.GroupNormalization(groups=2),
    ]
    if hasattr(keras.layers, "RMSNormalization"):
        layers.append(keras.layers.RMSNormalization())
    return layers


def sensitive_layers():
    """One instance of every built-in forced layer that keeps the shape (None, 8):
    softmax, UnitNormalization, and normalization layers this Keras does not
    compute in float32 itself (GroupNormalization before Keras 3.15)."""
    return [keras.layers.UnitNormalization(), keras.layers.Softmax()] + [
        layer for layer in _normalization_layers() if not _registry.keras_float32_reason(layer)]


def keras_float32_layers():
    """Normalization layers this Keras computes in float32 itself (left 16-bit)."""
    return [layer for layer in _normalization_layers() if _registry.keras_float32_reason(layer)]


def assert_forced(model, sensitive, x, low=()):
    """``sensitive`` compute in float32, ``low`` in 16 bits; outputs float32
    (symbolic when there is a graph, and at run time)."""
    for layer in sensitive:
        assert layer.compute_dtype == "float32", layer.name
    for layer in low:
        assert layer.compute_dtype in LOW, layer.name
    for tensor in getattr(model, "outputs", None) or []:
        assert tensor.dtype == "float32"
    for y in keras.tree.flatten(model(x)):
        assert keras.backend.standardize_dtype(y.dtype) == "float32"


@pytest.mark.parametrize("policy", MIXED)
def test_foundation_common_case(policy):
    keras.config.set_dtype_policy(policy)
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(512, activation="relu")
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden(inputs)))
    assert model.outputs[0].dtype in LOW
    assert tfmp.force_float32(model) is model
    assert hidden.compute_dtype in LOW
    assert_forced(model, [model.layers[-1]], np.ones((2, 784), "float32"))


@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("build_first", [True, False])
def test_sequential(policy, build_first):
    keras.config.set_dtype_policy(policy)
    sensitive, kept = sensitive_layers(), keras_float32_layers()
    model = keras.Sequential([keras.layers.Dense(8)] + sensitive + kept + [keras.layers.Dense(3)])
    if build_first:
        model.build((None, 4))
    tfmp.force_float32(model)
    model.build((None, 4))
    assert model.layers[0].compute_dtype in LOW
    assert_forced(model, sensitive + [model.layers[-1]], np.ones((2, 4), "float32"), low=kept)
    # The graph shows plain Keras's dtypes except the output: forced layers hand back 16 bits.
    assert [layer.output.dtype for layer in model.layers] == [policy[6:]] * (len(model.layers) - 1) + ["float32"]


@pytest.mark.parametrize("policy", MIXED)
def test_functional_multi_output_and_raw_ops(policy):
    keras.config.set_dtype_policy(policy)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8)(inputs)
    norm = keras.layers.LayerNormalization()
    a, b = keras.layers.Dense(3, name="a"), keras.layers.Dense(3, name="b")
    head = keras.layers.Dense(2, name="head")
    summed = keras.ops.softmax(a(norm(hidden)) + b(hidden)) * 2.0  # raw ops last
    model = keras.Model(inputs, {"summed": summed, "head": head(hidden)})
    nodes_before = [len(layer._inbound_nodes) for layer in model.layers]
    tfmp.force_float32(model)
    assert [len(layer._inbound_nodes) for layer in model.layers] == nodes_before
    assert model.layers[1].compute_dtype in LOW
    assert_forced(model, [a, b, head], np.ones((2, 4), "float32"), low=[norm])


class Tower(keras.Model):
    """Subclassed model, built lazily; output computed with raw ops."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(8)
        self.norm = keras.layers.LayerNormalization()
        self.probs = keras.layers.Softmax()
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return keras.ops.tanh(self.out(self.probs(self.norm(self.dense(x))))) * 2.0


@pytest.mark.parametrize("policy", MIXED)
def test_subclassed_lazy_model(policy):
    keras.config.set_dtype_policy(policy)
    model = Tower()
    tfmp.force_float32(model)
    assert_forced(model, [model.probs], np.ones((2, 4), "float32"), low=[model.dense, model.norm])
    # The forced softmax hands the model's own 16-bit dtype back to its code.
    probs = model.probs(np.ones((2, 8), "float32"))
    assert keras.backend.standardize_dtype(probs.dtype) == policy[6:]
    model.compile("sgd", "mse")
    model.fit(np.ones((4, 4)), np.ones((4, 3)), epochs=1, verbose=0)


@pytest.mark.parametrize("policy", MIXED)
def test_nested_models(policy):
    keras.config.set_dtype_policy(policy)
    inner_in = keras.Input((4,))
    inner_norm = keras.layers.BatchNormalization()
    inner = keras.Model(inner_in, keras.layers.Dense(4)(inner_norm(inner_in)), name="inner")
    tower = Tower()
    inputs = keras.Input((4,))
    outputs = [inner(inputs), keras.layers.Dense(2)(inner(inputs)), tower(inputs)]
    model = keras.Model(inputs, outputs)
    tfmp.force_float32(model)
    assert_forced(model, [inner.layers[-1], tower.probs], np.ones((2, 4), "float32"),
                  low=[inner_norm, tower.norm])


@pytest.mark.parametrize("policy", MIXED)
def test_embedding_mixes_with_dense(policy):
    keras.config.set_dtype_policy(policy)
    tokens, features = keras.Input((5,), dtype="int32"), keras.Input((3,))
    embedded = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 8)(tokens))
    dense = keras.layers.Dense(8)(features)
    norm = keras.layers.UnitNormalization()(dense)  # forced; hands back 16 bits
    joined = keras.ops.concatenate([embedded, norm], axis=-1)  # raw op on 16-bit tensors
    mixed = keras.layers.Concatenate()([embedded, norm]) + joined
    model = keras.Model([tokens, features], keras.layers.Dense(1)(mixed))
    tfmp.force_float32(model)
    assert norm.dtype == joined.dtype == policy[6:]
    model.compile("sgd", "mse")
    x = [np.ones((4, 5), "int32"), np.ones((4, 3), "float32")]
    model.fit(x, np.ones((4, 1)), epochs=1, verbose=0)
    assert_forced(model, [], x)


@pytest.mark.parametrize(
    "activation, position, forced",
    [("softmax", "output", True), ("log_softmax", "output", True), ("sigmoid", "output", True),
     ("softmax", "hidden", True), ("sigmoid", "hidden", False)],
)
def test_fused_activations(activation, position, forced):
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    layer = keras.layers.Dense(8, activation=activation)
    x = layer(inputs)
    if position == "hidden":
        x = keras.layers.Dense(2)(x)
    tfmp.force_float32(keras.Model(inputs, x))
    assert (layer.compute_dtype == "float32") is forced


def group_norm_model(values_shape=(16, 16, 64)):
    inputs = keras.Input(values_shape)
    norm = keras.layers.GroupNormalization(groups=8, epsilon=1e-12)
    return keras.Model(inputs, keras.layers.Conv2D(8, 1)(norm(inputs))), norm


def test_group_normalization_large_inputs_finite_even_without_tfmp_on_keras_3_15():
    # From Keras 3.15 on, GroupNormalization computes its statistics in float32
    # itself (autocast=False, inputs upcast): the unforced model is finite too, and
    # tfmp leaves it in float16 (its output-dtype rule). On Keras 3.12-3.14 the layer
    # autocasts its float32 inputs to float16 first (70,000 becomes inf): there the
    # plain model is NaN and tfmp's forcing is what keeps it finite.
    keras.config.set_dtype_policy("mixed_float16")
    values = np.random.default_rng(0).uniform(60_000, 70_000, (2, 16, 16, 64)).astype("float32")
    plain, plain_norm = group_norm_model()
    assert plain_norm.compute_dtype == "float16"
    keras_does_it = keras_at_least("3.15")
    assert np.isfinite(keras.ops.convert_to_numpy(plain(values))).all() == keras_does_it
    model, norm = group_norm_model()
    tfmp.force_float32(model)
    outputs = keras.ops.convert_to_numpy(model(values))
    assert norm.compute_dtype == ("float16" if keras_does_it else "float32")
    assert outputs.dtype == np.float32
    assert np.isfinite(outputs).all()


def test_softmax_on_logits_beyond_float16_needs_forcing():
    # Logits above 65504 (float16's largest value) become inf when a float16
    # Softmax casts its inputs. Whatever the kernel (max subtracted, inf - inf; or
    # not, inf / inf), an overflowed logit's probability is then NaN; what the
    # others get depends on the kernel. Forced to float32 by tfmp, the layer sees
    # the float32 logits.
    keras.config.set_dtype_policy("mixed_float16")
    logits = np.array(
        [[70_000.0, 69_000.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]], dtype="float32"
    )

    def softmax_model():
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Softmax()(inputs))

    plain = keras.ops.convert_to_numpy(softmax_model()(logits))
    assert np.isnan(plain[0, :2]).all()  # without tfmp: the overflowed logits
    model = softmax_model()
    tfmp.force_float32(model)
    forced = keras.ops.convert_to_numpy(model(logits))
    assert forced.dtype == np.float32
    np.testing.assert_array_equal(forced[0], [1.0, 0.0, 0.0, 0.0])  # e**-1000 is 0
    expected = np.exp([1.0, 2.0, 3.0, 4.0]) / np.exp([1.0, 2.0, 3.0, 4.0]).sum()
    np.testing.assert_allclose(forced[1], expected, rtol=1e-6)



def _softmax_input_gradients(scores, upstream, with_tfmp):
    """Gradient of ``sum(Dense(softmax(scores)))`` with respect to ``scores`` under
    mixed_bfloat16, the Dense kernel set to ``upstream`` (so the gradient reaching
    the softmax is ``upstream`` itself: its values are exact in bfloat16)."""
    import tensorflow as tf

    def build():
        inputs = keras.Input((scores.shape[1],))
        head = keras.layers.Dense(1, use_bias=False)
        model = keras.Model(inputs, head(keras.layers.Softmax()(inputs)))
        model.compile("sgd", "mse")  # tfmp forces at compile while enabled
        return model, head

    if with_tfmp:
        with tfmp.policy_scope("mixed_bfloat16"):
            model, head = build()
    else:
        keras.config.set_dtype_policy("mixed_bfloat16")  # restored by conftest
        model, head = build()
        keras.config.set_dtype_policy("float32")
    head.set_weights([upstream[:, None]])
    x = tf.constant(scores)
    with tf.GradientTape() as tape:
        tape.watch(x)
        total = tf.reduce_sum(tf.cast(model(x), tf.float32))
    return tape.gradient(total, x).numpy().astype(np.float64)


def test_softmax_backward_under_bfloat16_needs_forcing():
    # A bfloat16 softmax's forward pass is float32's rounded once on oneDNN CPUs
    # (benchmarks/softmax_precision.py), but its gradient, y * (g - sum(g * y)),
    # rounds sum(g * y) to 8 bits and subtracts: on peaked rows (logits spread
    # over tens, as trained attention is) that leaves a gradient far from the true
    # one. tfmp's forced Softmax takes the gradient in float32 and rounds it once.
    rng = np.random.default_rng(0)
    as_bf16 = lambda a: keras.ops.convert_to_numpy(  # noqa: E731
        keras.ops.cast(keras.ops.cast(a, "bfloat16"), "float32"))
    scores = as_bf16(30.0 * rng.normal(size=(256, 128)).astype("float32"))
    upstream = as_bf16(rng.normal(size=128).astype("float32"))
    s64 = scores.astype(np.float64)
    y = np.exp(s64 - s64.max(axis=1, keepdims=True))
    y /= y.sum(axis=1, keepdims=True)
    expected = y * (upstream - (y * upstream).sum(axis=1, keepdims=True))  # float64, by hand
    norms = np.linalg.norm(expected, axis=1)
    rows = norms > 1e-6  # rows whose gradient float32 itself resolves

    def row_errors(got):
        return np.linalg.norm(got - expected, axis=1)[rows] / norms[rows]

    plain = row_errors(_softmax_input_gradients(scores, upstream, with_tfmp=False))
    forced = row_errors(_softmax_input_gradients(scores, upstream, with_tfmp=True))
    assert rows.sum() > 100
    # Measured on a Zen 4: plain Keras's row errors median 0.065, 90th percentile
    # 0.75; tfmp's 3e-6 and 5e-4.
    assert np.percentile(plain, 90) > 0.25  # a tenth of plain Keras's rows off by > 25%
    assert np.percentile(forced, 90) < 2**-8

def masked_attention_probabilities(mha, mask):
    x = np.random.default_rng(1).normal(size=(2, 6, 8)).astype("float32") * 30.0
    _, scores = mha(x, x, attention_mask=mask, return_attention_scores=True)
    return keras.ops.convert_to_numpy(scores)


@pytest.mark.parametrize("lazy", [False, True])
def test_masked_multi_head_attention(lazy):
    keras.config.set_dtype_policy("mixed_float16")
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)

    class Block(keras.Model):
        def __init__(self):
            super().__init__()
            self.mha, self.out = mha, keras.layers.Dense(4)

        def call(self, x):
            return self.out(self.mha(x, x))

    model = Block()
    if not lazy:
        model(np.ones((1, 6, 8), "float32"))
    tfmp.force_float32(model)
    mask = np.tril(np.ones((6, 6), bool))[None].repeat(2, axis=0)
    probs = masked_attention_probabilities(mha, mask)
    assert mha.compute_dtype == "float16" and mha._softmax.compute_dtype == "float32"
    assert probs.dtype == np.float16  # handed back to the attention's 16-bit code
    probs = probs.astype(np.float32)
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-3)
    assert (probs[np.broadcast_to(~mask[:, None], probs.shape)] < 1e-3).all()


def test_idempotent_and_touches_nothing_else():
    keras.config.set_dtype_policy("mixed_float16")
    model = Tower()
    tfmp.force_float32(model)
    model(np.ones((1, 4)))
    policies = [layer.dtype_policy for layer in model.layers]
    call = model.call
    tfmp.force_float32(model)
    assert [layer.dtype_policy for layer in model.layers] == policies
    assert model.call is call
    assert [layer.compute_dtype for layer in model.layers] == ["float16", "float16", "float32", "float16"]
    assert [hook.owner for hook in patches.installed(model.probs, "call")] == ["float32.cast_back"]


def test_float32_policy_is_left_alone():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Softmax()(keras.layers.Dense(3)(inputs)))
    policies = [layer.dtype_policy for layer in model.layers]
    tfmp.force_float32(model)
    assert [layer.dtype_policy for layer in model.layers] == policies


def test_keep_and_exclude_arguments():
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, name="proj"), keras.layers.Dense(8, name="mid"),
        keras.layers.LayerNormalization(name="norm"), keras.layers.Dense(2, name="logits"),
    ])
    tfmp.force_float32(model, keep="pro*", exclude=[keras.layers.LayerNormalization, "logits"])
    dtypes = {layer.name: layer.compute_dtype for layer in model.layers}
    assert dtypes == {"proj": "float32", "mid": "float16", "norm": "float16", "logits": "float16"}
    assert model.outputs[0].dtype == "float16"
    assert model.get_layer("proj").output.dtype == "float16"  # a user rule hands back 16 bits


def test_forcing_a_block_forces_its_sublayers():
    keras.config.set_dtype_policy("mixed_float16")
    model = Tower()
    model(np.ones((1, 4)))
    outer = keras.Sequential([keras.Input((4,)), model, keras.layers.Dense(2)])
    tfmp.force_float32(outer, keep=[Tower])
    assert all(layer.compute_dtype == "float32" for layer in model.layers)
    # Inside a float32 block, a forced softmax hands back float32 (its parent's dtype).
    assert keras.backend.standardize_dtype(model.probs(np.ones((1, 8))).dtype) == "float32"
    assert outer.layers[0].output.dtype == "float16"  # the block itself hands back 16 bits


def test_registry_api_and_context_manager():
    keras.config.set_dtype_policy("mixed_float16")
    with tfmp.register_float32(keras.layers.Dense, "*mid"):
        assert tfmp.float32_layers().keep == (keras.layers.Dense, "*mid")
        tfmp.register_float32(keras.layers.Softmax, exclude=True)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Softmax()])
        tfmp.force_float32(model)
        assert [layer.compute_dtype for layer in model.layers] == ["float32", "float16"]
    assert tfmp.float32_layers().keep == ()
    assert keras.layers.Softmax in tfmp.float32_layers().builtin
    tfmp.unregister_float32(keras.layers.Softmax)
    assert tfmp.float32_layers().exclude == ()
    with pytest.raises(RuntimeError), tfmp.register_float32("x"):
        raise RuntimeError("boom")
    assert tfmp.float32_layers().keep == ()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: tfmp.register_float32(keras.layers.Dense(2)), "Invalid `targets` argument"),
        (lambda: tfmp.unregister_float32("logitz"), "Received: targets='logitz'"),
        (lambda: tfmp.force_float32(keras.layers.Dense(2)), "Invalid `model` argument"),
        (lambda: tfmp.force_float32(Tower(), keep=[3]), "Invalid `keep` argument"),
        (lambda: tfmp.force_float32(Tower(), keep=keras.layers.Dense(3)), "not an instance"),
        (lambda: tfmp.register_float32(b"x"), r"Received: targets=b'x'"),
    ],
)
def test_errors_follow_the_template(call, message):
    with pytest.raises(ValueError, match=message):
        call()


class Fragile(keras.layers.Layer):
    """Output layer whose symbolic spec cannot be recomputed once in float32."""

    def call(self, x):
        return x * 2.0

    def compute_output_spec(self, x):
        if self.compute_dtype == "float32":
            raise NotImplementedError("no spec")
        return keras.KerasTensor(x.shape, dtype=self.compute_dtype)


def test_unrefreshable_spec_warns_but_runtime_is_float32():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, Fragile(name="fragile")(keras.layers.Dense(4)(inputs)))
    with pytest.warns(UserWarning, match="'fragile'"):
        tfmp.force_float32(model)
    assert model(np.ones((1, 4))).dtype == "float32"


class Attention(keras.Model):
    """Subclassed model around an unbuilt MultiHeadAttention."""

    def __init__(self):
        super().__init__()
        self.mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)

    def call(self, x):
        return self.mha(x, x)


@pytest.mark.parametrize("exclude_later, softmax_dtype", [(False, "float32"), (True, "float16")])
def test_deferred_forcing_uses_the_latest_options(exclude_later, softmax_dtype):
    keras.config.set_dtype_policy("mixed_float16")
    model = Attention()
    tfmp.force_float32(model)
    if exclude_later:
        tfmp.force_float32(model, exclude="*softmax")
    model(np.ones((1, 3, 8), "float32"))
    assert model.mha._softmax.compute_dtype == softmax_dtype


def _compiled_with_a_forced_middle_softmax():
    with warnings.catch_warnings(), tfmp.policy_scope("mixed_bfloat16"):
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        inputs = keras.Input((4,))
        x = keras.layers.Softmax()(keras.layers.Dense(4)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(2)(x))
        model.compile("sgd", "mse")
    return model


def test_a_forced_layer_goes_with_its_model():
    """tfmp's state on a forced layer (its cast-back hooks) does not keep it alive."""
    import weakref

    from tfmp._src.float32 import cast_back

    model = _compiled_with_a_forced_middle_softmax()
    softmax = model.get_layer(index=2)
    assert isinstance(softmax, keras.layers.Softmax) and cast_back.casts_back(softmax)
    layer_ref, model_ref = weakref.ref(softmax), weakref.ref(model)
    del model, softmax
    keras.backend.clear_session()
    collect_everything()
    assert model_ref() is None and layer_ref() is None
