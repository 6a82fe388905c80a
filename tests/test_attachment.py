"""Tests for tfmp/_src/attachment: a model keeps what tfmp decided when it attached it."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from _collect import collect_everything
from _machines import SAPPHIRE_RAPIDS, ZEN4

import tfmp
from tfmp._src.attachment import hooks as attachment_hooks
from tfmp._src.float32 import conv, fused_batchnorm
from tfmp._src.keras_hooks import patches
from tfmp._src.keras_hooks import backend_ops
from tfmp._src.policy.hardware import injected_facts

pytestmark = pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")  # 16 bits emulated on CPUs
X = np.random.RandomState(0).normal(size=(8, 6, 6, 3)).astype("float32")
Y = np.zeros((8, 2), "float32")


@pytest.fixture(autouse=True)
def disabled():
    yield
    tfmp.disable()


class KLTerm(keras.layers.Layer):
    """Adds a loss term from its 16-bit input (the Keras VAE example's KL term)."""

    def call(self, x):
        self.add_loss(1e-3 * tf.reduce_mean(tf.square(x)))
        return x


def cnn(kl=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    if kl:
        x = KLTerm(name="kl")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(x))


def step_ops(model):
    """Op types of `model`'s train step, traced now in a tf.function of our own."""
    step = tf.function(lambda x, y: model.train_step((x, y)))
    graph = step.get_concrete_function(tf.TensorSpec((8, 6, 6, 3)), tf.TensorSpec((8, 2))).graph
    return sorted(op.type for op in graph.get_operations())


def test_a_model_traces_the_same_graph_inside_and_after_its_scope():
    with tfmp.policy_scope("mixed_bfloat16"):
        model = cnn()
        model.compile("sgd", "mse")
        inside = step_ops(model)
    after = step_ops(model)
    assert "FusedBatchNormV3" in inside
    assert after == inside
    tfmp.disable()
    assert step_ops(model) == inside
    model.fit(X, Y, batch_size=4, verbose=0)  # Keras's own trace, after the scope
    assert fused_batchnorm.last_call_reason(model.get_layer("bn")) == ""


def test_the_same_graph_is_traced_in_another_thread():
    with tfmp.policy_scope("mixed_bfloat16"):
        model = cnn()
        model.compile("sgd", "mse")
        here = step_ops(model)
    there = []
    thread = threading.Thread(target=lambda: there.append(step_ops(model)))
    thread.start()
    thread.join()
    assert there == [here]


def test_a_model_compiled_while_enabled_sums_its_16_bit_loss_terms_after_disable():
    tfmp.enable("mixed_bfloat16")
    model = cnn(kl=True)
    model.compile("sgd", "mse")
    tfmp.disable()
    history = model.fit(X, Y, batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_plain_keras_fails_on_the_same_16_bit_loss_term():
    keras.config.set_dtype_policy("mixed_bfloat16")  # the conftest fixture restores it
    model = cnn(kl=True)
    model.compile("sgd", "mse")
    with pytest.raises(TypeError, match="bfloat16"):
        model.fit(X, Y, batch_size=4, verbose=0)


def test_the_attachment_records_what_tfmp_decided():
    tfmp.enable("mixed_bfloat16")
    model = cnn()
    model.compile("sgd", "mse")
    found = tfmp.attachment(model)
    assert isinstance(found, tfmp.Attachment)
    assert (found.attached_by, found.policy, found.model) == ("compile", "mixed_bfloat16", model.name)
    assert found.forced_float32 == {"out": "output"}
    assert found.layer_policies == {"conv": "mixed_bfloat16", "bn": "mixed_bfloat16",
                                    "pool": "mixed_bfloat16", "out": "float32"}
    assert found.batchnorm_kernel == {"bn": "fused"}
    assert found.explains_dtype_errors and found.loss_terms_in_float32 and not found.check_numerics
    assert found.exact_ids == 0


def test_a_model_compiled_without_a_session_is_not_attached():
    model = cnn()
    model.compile("sgd", "mse")
    assert tfmp.attachment(model) is None
    with pytest.raises(ValueError, match="Invalid `model` argument"):
        tfmp.attachment("model")


def test_a_model_compiled_in_another_thread_without_a_session_is_not_attached():
    tfmp.enable("mixed_bfloat16")
    built = []

    def build():  # plain Keras mixed precision in a thread without a session
        keras.config.set_dtype_policy("mixed_bfloat16")  # Keras's global policy is per thread
        model = cnn()
        model.compile("sgd", "mse")
        built.append(model)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    model = built[0]
    assert model.get_layer("bn").compute_dtype == "bfloat16"
    assert "FusedBatchNormV3" not in step_ops(model)  # traced here, in the enabled thread
    assert tfmp.attachment(model) is None and tfmp.attachment(model.get_layer("bn")) is None


class LateNorm(keras.layers.Layer):
    """Makes its BatchNormalization in build(): after the model was compiled and attached.

    With its own policy (a layer made in build() would take the policy of the thread
    that builds it, under Keras as under tfmp)."""

    def build(self, input_shape):
        self.norm = keras.layers.BatchNormalization(name="late_bn", dtype=self.dtype_policy)
        self.norm.build(input_shape)

    def call(self, x, training=None):
        return self.norm(x, training=training)


class LateModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv2D(4, 3)
        self.late = LateNorm()
        self.head = keras.layers.Dense(2)

    def call(self, x, training=None):
        pooled = keras.ops.mean(self.late(self.conv(x), training=training), axis=(1, 2))
        return self.head(pooled)


def test_a_sublayer_made_after_attaching_takes_its_models_attachment_in_any_thread():
    tfmp.enable("mixed_bfloat16")
    model = LateModel()
    model.compile("sgd", "mse")  # unbuilt: late_bn does not exist yet
    tfmp.disable()
    traced = []
    thread = threading.Thread(target=lambda: traced.append(step_ops(model)))  # no session there
    thread.start()
    thread.join()
    assert "FusedBatchNormV3" in traced[0]
    assert tfmp.attachment(model.late.norm) is tfmp.attachment(model)


def test_a_custom_loop_model_attaches_at_its_first_step_and_keeps_it_in_a_retrace():
    tfmp.enable("mixed_bfloat16")
    model = cnn(kl=True)  # never compiled: a custom training loop

    @tf.function
    def loss_of(x):
        out = model(x, training=True)
        return tf.reduce_mean(tf.square(tf.cast(out, "float32"))) + tf.add_n(model.losses)

    first = loss_of.get_concrete_function(tf.TensorSpec((8, 6, 6, 3))).graph
    tfmp.disable()
    retrace = loss_of.get_concrete_function(tf.TensorSpec((4, 6, 6, 3))).graph  # a last, smaller batch
    for graph in (first, retrace):
        assert "FusedBatchNormV3" in {op.type for op in graph.get_operations()}
    assert np.isfinite(float(loss_of(tf.constant(X[:4]))))  # the 16-bit term summed in float32
    assert tfmp.attachment(model.get_layer("bn")).attached_by == "first call"


def test_detach_gives_the_model_back_to_keras():
    original_call = vars(keras.layers.BatchNormalization)["call"]
    original_losses = vars(keras.layers.Layer)["losses"]
    original_gelu = backend_ops.backend_nn().gelu
    original_convs = [getattr(backend_ops.backend_nn(), name) for name in conv.FUNCTIONS]
    tfmp.enable("mixed_bfloat16")
    model = cnn(kl=True)
    model.compile("sgd", "mse")
    model.fit(X, Y, batch_size=4, verbose=0)
    tfmp.disable()
    found = tfmp.detach(model)
    assert found.attached_by == "compile"
    assert tfmp.attachment(model) is None and tfmp.attachment(model.get_layer("bn")) is None
    assert model.train_function is None
    bn_step = tf.function(lambda x: model.get_layer("bn")(x, training=True))
    graph = bn_step.get_concrete_function(tf.TensorSpec((8, 4, 4, 4), "bfloat16")).graph
    assert "FusedBatchNormV3" not in {op.type for op in graph.get_operations()}
    assert not any(h.owner in ("enable.dtype_errors", "float32.ids") for h in patches.installed(model))
    with pytest.raises(TypeError, match="bfloat16"):  # plain Keras again: the 16-bit term
        model.fit(X, Y, batch_size=4, verbose=0)
    assert tfmp.detach(model) is None  # detaching twice changes nothing
    model = found = None  # the lambda above holds `model` through its closure
    collect_everything()
    tfmp.disable()
    assert attachment_hooks.installed() == []
    assert vars(keras.layers.BatchNormalization)["call"] is original_call
    assert vars(keras.layers.Layer)["losses"] is original_losses
    assert backend_ops.backend_nn().gelu is original_gelu
    assert [getattr(backend_ops.backend_nn(), name) for name in conv.FUNCTIONS] == original_convs


def test_the_attachment_lists_every_subscription_and_detach_leaves_only_float32_forcing_and_the_optimizers():
    from tfmp._src.attachment.attach import subscriptions
    from tfmp._src.keras_hooks import surfaces, train_function

    before = surfaces.process_wide()  # what other tests' live objects still hold
    data = np.ones((8, 4), "float32"), np.eye(2, dtype="float32")[[0, 1] * 4]
    tfmp.enable("mixed_float16", debug=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                              keras.layers.Dense(2, activation="softmax", name="probs")])
    model.compile(keras.optimizers.Adam(1e-3), "categorical_crossentropy")
    model.second_optimizer = keras.optimizers.SGD()  # an optimizer a custom compile keeps: wrapped
    model.fit(*data, batch_size=4, verbose=0)
    found = tfmp.attachment(model).subscriptions
    rows = {row for object_rows in found.values() for row in object_rows}
    assert "layer calls: call (numerics)" in found["hidden"]
    assert "trainer: train_step (numerics)" in found["model"]
    assert {"trainer: train step check numerics", "trainer: train step check stuck"} <= set(found["model"])
    assert "optimizer steps: apply (numerics)" in found["optimizer"]
    assert all(row.split(": ")[0] in {s.name for s in surfaces.HOOKED} for row in rows)
    tfmp.disable()
    tfmp.detach(model)

    def owners():
        left = subscriptions(model)
        left.pop("optimizer", None)  # the optimizer is kept, with what the monitor or user put on it
        return {row.rsplit(" ", 1)[-1] for rows_ in left.values() for row in rows_}

    assert owners() <= {"(float32.outputs)", "(float32.cast_back)"}
    assert [(getattr(obj, "name", obj), name) for obj in [model, *model.layers] for name in vars(obj)
            if name.startswith("_tfmp_")] == []
    assert isinstance(model.second_optimizer, tfmp.LossScaleOptimizer)  # kept, as model.optimizer is
    nan_batch = np.full((8, 4), np.nan, "float32"), data[1]
    weights = [w.numpy() for w in model.weights]
    model.fit(*nan_batch, batch_size=8, verbose=0)  # the kept optimizer still skips and counts
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(weights, model.weights, strict=True))
    assert int(model.optimizer.overflow_count.numpy()) == 1
    assert owners() <= {"(float32.outputs)", "(float32.cast_back)"}  # fit put nothing back
    assert not train_function.has_check(model, "stuck") and "_tfmp_batch_check" not in vars(model)
    model = found = None  # `owners` holds `model` through its closure
    collect_everything()
    tfmp.disable()
    assert [hook for hook in surfaces.process_wide() if hook not in before] == []


MODEL_LEVEL_OWNERS = ["bias_gradient", "conv", "conv", "conv", "conv", "cross_entropy", "dropout",
                      "enable.gradient_errors", "enable.losses", "fused_batchnorm", "gelu"]  # conv: the backend's four


def test_without_a_session_the_model_level_hooks_are_on_only_while_an_attached_model_traces_its_step():
    tfmp.enable("mixed_bfloat16")
    model = cnn(kl=True)
    model.compile("sgd", "mse")
    assert sorted(hook.owner for hook in attachment_hooks.installed()) == MODEL_LEVEL_OWNERS
    tfmp.disable()
    assert attachment_hooks.installed() == []  # the attached model is alive, but not stepping
    seen = []
    bn = model.get_layer("bn")
    bn_call = bn.call
    bn.call = lambda *args, **kwargs: seen.append(sorted(h.owner for h in attachment_hooks.installed())) or bn_call(
        *args, **kwargs)
    model.fit(X, Y, batch_size=4, verbose=0)  # plain Keras would raise on the 16-bit KL term
    assert seen and seen[0] == MODEL_LEVEL_OWNERS  # on while Keras traced the step
    assert attachment_hooks.installed() == []  # and off after it
    with tfmp.step_scope(model):  # a custom loop's block
        assert sorted(hook.owner for hook in attachment_hooks.installed()) == MODEL_LEVEL_OWNERS
    assert attachment_hooks.installed() == []


def test_a_custom_loop_model_attached_at_its_first_call_keeps_the_model_level_hooks_while_it_lives():
    tfmp.enable("mixed_bfloat16")
    model = cnn()  # never compiled: no step tfmp can wrap
    model(X[:2], training=True)
    tfmp.disable()
    assert sorted(hook.owner for hook in attachment_hooks.installed()) == MODEL_LEVEL_OWNERS
    del model
    collect_everything()
    tfmp.disable()
    assert attachment_hooks.installed() == []


def _tfmp_frames(run):
    """Counts, per ``file:function``, the calls of tfmp's own code while `run()` runs (a profile hook)."""
    import collections
    import os
    import sys

    root = os.path.dirname(tfmp.__file__)
    seen = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen[f"{os.path.relpath(frame.f_code.co_filename, root)}:{frame.f_code.co_name}"] += 1

    threading.setprofile(profile)  # also the threads Keras's fit may start
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return dict(seen)


def test_a_model_tfmp_did_not_attach_runs_no_tfmp_code_in_its_fit_while_an_attached_one_lives():
    def gelu_cnn():
        inputs = keras.Input((6, 6, 3))
        x = keras.layers.Conv2D(4, 3, activation="gelu", name="conv")(inputs)
        x = keras.layers.BatchNormalization(name="bn")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(2, activation="softmax", dtype="float32")(x))

    tfmp.enable("mixed_bfloat16")
    attached = gelu_cnn()
    attached.compile("adam", "categorical_crossentropy")
    tfmp.disable()
    keras.config.set_dtype_policy("mixed_bfloat16")  # plain Keras mixed precision (restored by conftest)
    plain = gelu_cnn()
    plain.compile("adam", "categorical_crossentropy")
    attached_frames = _tfmp_frames(lambda: attached.fit(X, Y, batch_size=4, verbose=0))
    plain_frames = _tfmp_frames(lambda: plain.fit(X, Y, batch_size=4, verbose=0))
    assert plain_frames == {}
    assert any(name.startswith("_src/float32/") for name in attached_frames)  # the profile sees tfmp's code


@keras.saving.register_keras_serializable(package="tfmp_tests")
class SavedTokens(keras.layers.Layer):
    """A custom layer around an Embedding (its __call__ autocasts float ids), saveable."""

    def __init__(self, vocab, **kwargs):
        super().__init__(**kwargs)
        self.vocab = vocab
        self.embedding = keras.layers.Embedding(vocab, 4, name="embedding")

    def call(self, ids):
        return self.embedding(ids)

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab}


def test_exact_float_ids_are_kept_by_a_model_loaded_while_enabled(tmp_path):
    tfmp.enable("mixed_bfloat16")
    inputs = keras.Input(shape=(2,))  # float32 ids, as many tutorials declare them
    pooled = keras.layers.GlobalAveragePooling1D()(SavedTokens(2000, name="tokens")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(pooled))
    model.compile("sgd", "mse")
    model.fit(np.ones((2, 2), "float32"), np.zeros((2, 1), "float32"), verbose=0)
    path = str(tmp_path / "ids.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert tfmp.attachment(loaded).attached_by == "load"
    assert tfmp.attachment(loaded).exact_ids == 1
    tokens = loaded.get_layer("tokens")
    rows = tokens(np.array([[1001, 1999]], "float32"))[0]  # 1999 rounds to 2000 in bfloat16
    table = tokens.embedding.embeddings
    expected = keras.ops.cast(keras.ops.take(table, np.array([1001, 1999]), axis=0), "bfloat16")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(rows), keras.ops.convert_to_numpy(expected))


@pytest.mark.parametrize("session", ["mixed_bfloat16", "float32", "auto"])
def test_a_float16_file_loaded_under_another_policy_keeps_the_float16_decisions(tmp_path, session):
    """Its layers stay float16 while Keras gives the model and its inputs the session's policy: on a
    CPU whose oneDNN takes float16 the attachment decides for the layers (float32-inside
    convolutions, the remapper off), not for the model's own policy."""
    path = str(tmp_path / "float16.keras")
    with injected_facts(SAPPHIRE_RAPIDS):
        with tfmp.policy_scope("mixed_float16"):
            inputs = keras.Input((6, 6, 3))
            x = keras.layers.DepthwiseConv2D(3, padding="same")(keras.layers.Conv2D(4, 3, padding="same")(inputs))
            model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))
            model.compile("sgd", "mse")
            model.save(path)
        tfmp.enable(session)
        loaded = keras.models.load_model(path)
    found = tfmp.attachment(loaded)
    assert found.attached_by == "load"
    assert loaded.dtype_policy.name != "mixed_float16"  # Keras's, the premise
    assert {layer.dtype_policy.name for layer in loaded.layers[1:-1]} == {"mixed_float16"}
    assert found.conv.startswith(conv.FLOAT32_INSIDE) and found.depthwise_conv.startswith(conv.FLOAT32_INSIDE)
    assert found.remapper.startswith("off")


@pytest.mark.parametrize("session", ["mixed_bfloat16", "float32"])
def test_a_float16_file_compiled_again_under_another_policy_keeps_loss_scaling(tmp_path, session, capsys):
    """Fine-tuning a float16 model loaded under a bfloat16 or float32 session: its float16 layers' gradients
    still need loss scaling, and the compile line names the policy they compute in."""
    path = str(tmp_path / "float16.keras")
    with tfmp.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(8)(inputs)), name="clf")
        model.compile("adam", "mse")
        model.save(path)
    with tfmp.policy_scope(session, verbose=True):
        loaded = keras.models.load_model(path)
        capsys.readouterr()
        loaded.compile(keras.optimizers.Adam(1e-3), "mse")
    assert loaded.dtype_policy.name == session  # Keras's, the premise
    assert isinstance(loaded.optimizer, tfmp.LossScaleOptimizer) and loaded.optimizer.loss_scaling
    found = tfmp.attachment(loaded)
    assert found.policy == "mixed_float16" and list(found.forced_float32.values()) == ["output"]
    assert capsys.readouterr().out.startswith("tfmp: model 'clf' compiled under mixed_float16; 1 layer forced")
    assert "policy_mismatch" not in tfmp.audit(loaded).kinds  # the float32 output is tfmp's, not a mismatch
    loaded.fit(np.ones((8, 4), "float32"), np.zeros((8, 3), "float32"), verbose=0)
    assert loaded.optimizer.loss_scale > 1.0


def test_one_float16_layer_among_bfloat16_ones_gets_loss_scaling_and_the_float16_decisions():
    """A float16 layer's gradients need loss scaling and its matmul stays out of the fused float16 trap,
    however many bfloat16 layers surround it."""
    with injected_facts(SAPPHIRE_RAPIDS), tfmp.policy_scope("mixed_bfloat16"):
        inputs = keras.Input((4,))
        x = keras.layers.Dense(8)(keras.layers.Dense(8)(keras.layers.Dense(8)(inputs)))
        model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8, dtype="mixed_float16")(x)))
        model.compile(keras.optimizers.SGD(0.1), "mse")
    assert model.optimizer.loss_scaling
    assert tfmp.attachment(model).remapper.startswith("off")


@keras.saving.register_keras_serializable(package="tfmp_tests")
class TransformerBlock(keras.layers.Layer):
    """The keras.io miniature GPT's block: sublayers made in __init__ without a dtype."""

    def __init__(self, dim=8, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.att = keras.layers.MultiHeadAttention(2, dim)
        self.ffn = keras.layers.Dense(dim)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(x + self.ffn(self.att(x, x)))

    def get_config(self):
        return {**super().get_config(), "dim": self.dim}


def test_a_custom_layer_producing_an_output_loads_while_enabled(tmp_path):
    tfmp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    x = TransformerBlock(name="block")(keras.layers.Embedding(50, 8)(tokens))
    model = keras.Model(tokens, [keras.layers.Dense(50, name="logits")(x), x])  # as the GPT returns [logits, x]
    model.compile("adam", ["sparse_categorical_crossentropy", None])
    ids = np.arange(10).reshape(2, 5) % 50
    model.fit(ids, ids, verbose=0)
    path = str(tmp_path / "gpt.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    def dtypes(m):
        return sorted((type(layer).__name__, layer.compute_dtype) for layer in m.get_layer("block")._flatten_layers())

    assert dtypes(loaded) == dtypes(model)  # decided once when attached, kept through saving and loading
    # The block's body stays 16-bit, only its output is cast to float32; its softmax is forced, its
    # LayerNormalization left to Keras (float32 inside Keras).
    body = dict(dtypes(model))
    sixteen_bit = ("TransformerBlock", "Dense", "EinsumDense", "LayerNormalization")
    assert [body[name] for name in sixteen_bit] == ["bfloat16"] * 4
    assert body["Softmax"] == "float32"
    for before, after in zip(model(ids), loaded(ids)):
        assert after.dtype == "float32"
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(after), keras.ops.convert_to_numpy(before))
    assert keras.config.dtype_policy().name == "mixed_bfloat16"  # the global policy is back after loading


def test_a_detached_inner_model_stays_detached_inside_an_attached_outer_model():
    with tfmp.policy_scope("mixed_bfloat16"):
        inner = cnn()
        inputs = keras.Input((6, 6, 3))
        outer = keras.Model(inputs, keras.layers.Softmax()(inner(inputs)))
        outer.compile("sgd", "mse")
    tfmp.detach(inner)
    outer.fit(X, Y, batch_size=4, verbose=0)  # the outer model's step is traced again
    assert tfmp.attachment(outer) is not None and tfmp.attachment(inner.get_layer("bn")) is None
    assert fused_batchnorm.last_call_reason(inner.get_layer("bn")) == fused_batchnorm.NOT_ATTACHED


def test_a_nested_loss_scale_optimizer_is_refused():
    with pytest.raises(ValueError, match="Invalid `inner_optimizer` argument"):
        tfmp.LossScaleOptimizer(tfmp.LossScaleOptimizer(keras.optimizers.SGD()))


@pytest.mark.parametrize("function", ["attachment", "detach"])
def test_a_refused_model_argument_names_the_function_called_in_its_fix(function):
    with pytest.raises(ValueError, match=rf"e\.g\. tfmp\.{function}\(model\)\."):
        getattr(tfmp, function)(None)


def test_an_optional_feature_whose_keras_surface_moved_is_off_with_one_warning_and_training_goes_on(monkeypatch):
    """As on a Keras that moved the backend's nn and numpy modules where `backend_ops.PLACES` does not
    look (as keras-nightly 3.16 did before tfmp knew ``backend.ops``): the GELU, convolution and
    bias-gradient features switch off; enable, compile, fit, save and load work."""
    import warnings

    from tfmp._src.keras_hooks import availability

    def moved():
        raise AttributeError("module 'keras.src.backend' has no attribute 'nn'")

    monkeypatch.setattr(backend_ops, "backend_nn", moved)
    monkeypatch.setattr(backend_ops, "backend_numpy", moved)
    x, y = np.ones((8, 8), "float32"), np.ones((8, 2), "float32")
    with injected_facts(ZEN4):  # a CPU where mixed_bfloat16 is fast: no PerformanceWarning
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with tfmp.policy_scope("mixed_bfloat16"):
                    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="gelu"),
                                              keras.layers.Dense(2)])
                    model.compile("adam", "mse")
            said = sorted(str(w.message) for w in caught if "turned one feature off" in str(w.message))
            assert len(said) == 4  # gelu, conv, cross_entropy, bias_gradient: once each
            assert {w.filename for w in caught if "turned one feature off" in str(w.message)} == {__file__}
            for feature, text in zip(("bfloat16 bias gradients", "exact GELU", "float16 convolutions",
                                      "sparse cross-entropy from 16-bit logits"), said):
                assert text.startswith(f"tfmp turned one feature off in this process: {feature}")
                assert f"Keras {keras.__version__}" in text
                assert "has no attribute 'nn'" in text and "works as under plain Keras" in text
            found = tfmp.attachment(model)
            assert found.gelu.startswith("keras: off, Keras ") and found.bias_gradient.startswith("keras: off, ")
            assert found.cross_entropy.startswith("keras: off, Keras ")
            assert found.conv == "keras"  # a bfloat16 model: the convolution rule does not apply
            history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
            assert all(np.isfinite(history.history["loss"]))
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # said once per process
                with tfmp.policy_scope("mixed_bfloat16"):
                    again = keras.models.clone_model(model)
                    again.compile("adam", "mse")
            assert tfmp.attachment(again).gelu.startswith("keras: off, ")
        finally:
            availability.clear()
