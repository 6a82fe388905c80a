"""Tests for tfmp.audit (tfmp/_src/float32/audit.py): the table, the rows, every warning kind."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.float32.audit_batch import _dtype_mismatch_line


def digits_model(units=64):
    """The digits example's shape of model: 8x8 images flattened, 10 classes."""
    inputs = keras.Input((64,))
    x = keras.layers.Dense(units, activation="relu", name="hidden")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="probs")(x))


def kinds(report, path=None):
    return {w.kind for w in report.warnings if path is None or w.path == path}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_table_marks_forced_layers(policy):
    keras.config.set_dtype_policy(policy)
    low = policy[6:]
    model = tfmp.force_float32(digits_model())
    report = tfmp.audit(model, tensor_cores=False)
    text = str(report)
    print(text)
    header, rule = text.splitlines()[1:3]
    columns = ["layer", "class", "compute", "output", "variables", "why", "params", "warnings"]
    assert header.split() == columns
    assert len(header) <= len(rule)
    rows = [(r.path, r.compute_dtype, r.output_dtype, r.variable_dtype, r.forced, r.why, r.params,
             r.output_from) for r in report.rows]
    assert rows == [
        ("hidden", low, low, "float32", "", "", 64 * 64 + 64, "graph"),
        ("norm", low, low, "float32", "", "float32 inside Keras >= 3.12", 128, "graph"),
        ("probs", "float32", "float32", "float32", "output", "output", 650, "graph"),
    ]
    assert "float32 inside Keras >= 3.12" in text.splitlines()[4]
    assert sum(row.params for row in report.rows) == model.count_params()
    assert report.warnings == () and report.policy == policy
    assert report.float32_fraction == pytest.approx(650 / model.count_params())


def test_sensitive_and_output_16bit():
    keras.config.set_dtype_policy("mixed_float16")
    report = tfmp.audit(digits_model(), tensor_cores=False)
    assert kinds(report, "norm") == set()  # Keras computes LayerNormalization in float32
    assert kinds(report, "probs") == {"sensitive_16bit", "output_16bit"}
    assert report.rows[-1].warnings == ("sensitive_16bit", "output_16bit")


class Mix(keras.layers.Layer):
    """Custom code: its sublayers have no nodes in the model's graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.softmax = keras.layers.Softmax(name="softmax")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(x) + self.softmax(x)


def contract_model():
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(64, name="hidden")(inputs)
    aux = keras.layers.Dense(8, name="aux")(hidden)  # a model output that also feeds `mix`
    main = keras.layers.Dense(2, name="main")(Mix(name="mix")(aux))
    return keras.Model(inputs, [aux, main])


@pytest.mark.parametrize("with_batch", [False, True])
def test_audit_shows_the_output_dtype_contract(with_batch):
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = tfmp.force_float32(contract_model())
    batch = np.ones((8, 16), "float32") if with_batch else None
    report = tfmp.audit(model, batch=batch, tensor_cores=False)
    print(report)
    inner = "run" if with_batch else "rule"
    rows = [(r.path, r.class_name, r.compute_dtype, r.output_dtype, r.why, r.warnings, r.output_from)
            for r in report.rows]
    assert rows == [
        ("hidden", "Dense", "bfloat16", "bfloat16", "", (), "graph"),
        ("aux", "Dense", "float32", "float32", "output", ("consumer_dtype",), "graph"),
        ("mix", "Mix", "bfloat16", "bfloat16", "", (), "graph"),
        ("mix/softmax", "Softmax", "float32", "bfloat16", "softmax", (), inner),
        ("mix/norm", "LayerNormalization", "bfloat16", "bfloat16", "float32 inside Keras >= 3.12", (), inner),
        ("main", "Dense", "float32", "float32", "output", (), "graph"),
    ]
    assert [(w.kind, w.path, w.message) for w in report.warnings] == [(
        "consumer_dtype", "aux",
        ("'aux' (float32: output) hands float32 to 'mix', which computes in bfloat16: "
         "the value is cast at that boundary. Nothing to change unless 'mix' needs it in "
         "float32: then keep_float32=['mix'] in tfmp.enable() (keep=['mix'] in tfmp.force_float32)."),
    )]
    text = str(report)
    assert ("bfloat16*" in text) is not with_batch
    assert ("pass batch= to measure it" in text) is not with_batch


def test_output_dtype_measured_inside_custom_code_under_plain_keras():
    keras.config.set_dtype_policy("mixed_bfloat16")
    report = tfmp.audit(contract_model(), batch=np.ones((8, 16), "float32"), tensor_cores=False)
    rows = {r.path: (r.compute_dtype, r.output_dtype, r.why) for r in report.rows}
    assert rows["mix/softmax"] == ("bfloat16", "bfloat16", "")
    assert rows["aux"] == ("bfloat16", "bfloat16", "")
    assert "consumer_dtype" not in kinds(report)


def test_output_16bit_at_run_time_for_subclassed_models():
    keras.config.set_dtype_policy("mixed_float16")

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    model = Net()
    assert "output_16bit" in kinds(tfmp.audit(model, batch=np.ones((8, 4)), tensor_cores=False))
    tfmp.force_float32(model)
    assert kinds(tfmp.audit(model, batch=np.ones((8, 4)), tensor_cores=False)) == set()


def test_variables_16bit():
    keras.config.set_dtype_policy("float16")
    report = tfmp.audit(digits_model(), tensor_cores=False)
    assert "variables_16bit" in kinds(report, "hidden")
    assert report.rows[0].variable_dtype == "float16"


def test_a_layer_the_user_excluded_gets_no_sensitive_warning():
    def build():
        inputs = keras.Input((8,))
        x = keras.layers.Softmax(name="attn")(keras.layers.Dense(8, name="scores")(inputs))
        return keras.Model(inputs, keras.layers.Dense(2, name="out")(x))

    with tfmp.policy_scope("mixed_bfloat16", exclude_float32=[keras.layers.Softmax]):
        model = build()
        model.compile(optimizer="sgd", loss="mse")
        report = tfmp.audit(model, tensor_cores=False)
    assert model.get_layer("attn").compute_dtype == "bfloat16"
    assert kinds(report) == set()
    keras.config.set_dtype_policy("mixed_bfloat16")  # the fixture restores it
    assert kinds(tfmp.audit(build(), tensor_cores=False), "attn") == {"sensitive_16bit"}
    with tfmp.register_float32("attn", exclude=True):
        assert kinds(tfmp.audit(build(), tensor_cores=False), "attn") == set()


def test_policy_mismatch_when_built_before_enable():
    model = digits_model()  # built under float32
    with tfmp.policy_scope("mixed_bfloat16"):
        report = tfmp.audit(model, tensor_cores=False)
    mismatched = {w.path for w in report.warnings if w.kind == "policy_mismatch"}
    assert mismatched == {"hidden", "norm", "probs"}
    assert "rebuild" in report.warnings[0].message


def test_a_layer_its_author_pinned_to_float32_is_not_a_mismatch():
    """keras-hub makes its attention softmax with dtype="float32" in a model built under the policy."""
    with tfmp.policy_scope("mixed_bfloat16"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(8, name="hidden")(inputs)
        pinned = keras.layers.Softmax(dtype="float32", name="pinned_softmax")(hidden)
        other = keras.layers.Dense(8, dtype="mixed_float16", name="other_policy")(pinned)
        model = keras.Model(inputs, keras.layers.Dense(2, name="out")(other))
        report = tfmp.audit(model, tensor_cores=False)
    mismatched = {w.path for w in report.warnings if w.kind == "policy_mismatch"}
    assert mismatched == {"other_policy"}  # another 16-bit policy still is one


def test_no_policy_mismatch_after_disable():
    with tfmp.policy_scope("mixed_bfloat16"):
        model = digits_model()
        model.compile(optimizer="sgd", loss="mse")
    # The global policy is float32 again; the model is consistent with itself.
    report = tfmp.audit(model, tensor_cores=False)
    assert "policy_mismatch" not in {w.kind for w in report.warnings}


def test_first_line_names_the_policy_by_where_it_comes_from():
    """Never "global policy": the policy checked is the attachment's, enable()'s or the model's."""
    with tfmp.policy_scope("mixed_bfloat16"):
        attached = digits_model()
        attached.compile(optimizer="sgd", loss="mse")
        built_before = tfmp.audit(digits_model(), tensor_cores=False)  # not compiled: enable()'s
    keras.config.set_dtype_policy("mixed_float16")  # the fixture restores it
    own = digits_model()
    keras.config.set_dtype_policy("float32")  # the global policy moves on; the model's stays
    reports = [tfmp.audit(attached, tensor_cores=False), built_before, tfmp.audit(own, tensor_cores=False)]
    assert [(r.policy, r.policy_source) for r in reports] == [
        ("mixed_bfloat16", "attachment"), ("mixed_bfloat16", "enable"), ("mixed_float16", "model")]
    assert [str(r).splitlines()[0] for r in reports] == [
        "tfmp audit (policy tfmp attached the model under: mixed_bfloat16)",
        "tfmp audit (policy of tfmp.enable(): mixed_bfloat16)",
        "tfmp audit (model policy: mixed_float16)",
    ]


def test_tensor_core_dims_and_batch_size():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(12, 3)(inputs)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(10)(keras.layers.Dense(30)(x))
    model = tfmp.force_float32(keras.Model(inputs, outputs))
    report = tfmp.audit(model, tensor_cores=True, batch_size=12)
    messages = [w.message for w in report.warnings if w.kind == "tensor_core_dims"]
    assert any("filters 12" in m for m in messages)
    assert any("input channels 3" in m for m in messages)
    assert any("units 30" in m for m in messages) and any("batch size 12" in m for m in messages)
    assert not any("units 10" in m for m in messages)  # float32 output layer: no Tensor Cores
    assert "tensor_core_dims" not in kinds(tfmp.audit(model, tensor_cores=False, batch_size=12))


def test_aligned_model_has_no_dim_warnings():
    keras.config.set_dtype_policy("mixed_float16")
    model = tfmp.force_float32(digits_model())
    assert kinds(tfmp.audit(model, tensor_cores=True, batch_size=32)) == set()


def test_float32_heavy():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((64,))
    model = keras.Model(inputs, keras.layers.Dense(64)(keras.layers.Dense(4)(inputs)))
    report = tfmp.audit(tfmp.force_float32(model), tensor_cores=False)
    assert kinds(report) == {"float32_heavy"} and report.float32_fraction > 0.5


class AddConstant(keras.layers.Layer):
    """A custom layer with the classic bug: a float32 constant added to a 16-bit input."""

    def call(self, x):
        return tf.add(x, tf.constant(1.0))


def test_dtype_mismatch_names_layer_and_fix():
    keras.config.set_dtype_policy("mixed_float16")

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense, self.bump = keras.layers.Dense(8), AddConstant(name="bump")

        def call(self, x):
            return self.bump(self.dense(x))

    report = tfmp.audit(Net(), batch=(np.ones((8, 4)), np.ones((8, 8))), tensor_cores=False)
    (warning,) = [w for w in report.warnings if w.kind == "dtype_mismatch"]
    assert warning.path == "bump" and "self.compute_dtype" in warning.message
    # TensorFlow's own line, not Keras's "Exception encountered when calling" header.
    assert "was expected to be a half tensor but is a float tensor" in warning.message


class ScaledNoise(keras.layers.Layer):
    """Training-only bug: a float32 noise tensor added to the 16-bit input."""

    def call(self, x, training=False):
        if training:
            return x + tf.random.stateless_normal(tf.shape(x), seed=(1, 2))
        return x


class Net(keras.Model):
    """Dense -> BatchNormalization -> `last`; subclassed, so built by its first call."""

    def __init__(self, last):
        super().__init__(name="net")
        self.hidden, self.norm, self.last = keras.layers.Dense(8), keras.layers.BatchNormalization(), last

    def call(self, x, training=False):
        return self.last(self.norm(self.hidden(x), training=training), training=training)


def _mixed_dtype_model(layer):
    return Net(layer)


@pytest.mark.parametrize("layer_class", [AddConstant, ScaledNoise])
def test_dtype_mismatch_under_mixed_bfloat16_is_a_warning_naming_the_layer(layer_class):
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _mixed_dtype_model(layer_class(name="bump"))
    report = tfmp.audit(model, batch=np.ones((8, 4), "float32"), tensor_cores=False)
    assert [(w.kind, w.path) for w in report.warnings if w.kind == "dtype_mismatch"] == [
        ("dtype_mismatch", "bump")
    ]
    (warning,) = [w for w in report.warnings if w.kind == "dtype_mismatch"]
    assert "was expected to be a bfloat16 tensor but is a float tensor" in warning.message
    assert report.gradients == ()


class SplitHeads(keras.layers.Layer):
    """Shape bug: 8 features cannot be split into heads of 3."""

    def call(self, x, training=False):
        return keras.ops.reshape(x, (-1, 3, 3))


class TwoDense(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(8)

    def call(self, x):
        return self.dense(x)


def test_shape_bug_value_error_propagates_although_keras_prints_dtypes():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = TwoDense()
    model(np.ones((8, 4), "float32"))  # built for 4 features
    with pytest.raises(ValueError, match="expected axis -1 of input shape to have value 4") as info:
        tfmp.audit(model, batch=np.ones((8, 5), "float32"), tensor_cores=False)
    assert "Arguments received by TwoDense.call()" in str(info.value)
    assert "dtype=bfloat16" in str(info.value)  # what the old substring test took for a dtype error


def test_shape_bug_invalid_argument_error_propagates():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _mixed_dtype_model(SplitHeads(name="heads"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="Input to reshape") as info:
        tfmp.audit(model, batch=np.ones((8, 4), "float32"), tensor_cores=False)
    assert "dtype=bfloat16" in str(info.value)


def _raised(function):
    try:
        function()
    except Exception as error:  # the error under test
        return error
    raise AssertionError("did not raise")


def test_dtype_errors_are_told_by_the_failing_ops_first_line():
    def conversion():
        tf.convert_to_tensor(tf.ones([2]), dtype=tf.bfloat16)

    def unrelated_while_handling_a_dtype_error():
        try:
            tf.constant(1.0, tf.bfloat16) + tf.ones([2])
        except tf.errors.InvalidArgumentError:
            raise ValueError("bad shape; argument x=tf.Tensor(shape=(2,), dtype=bfloat16)")

    assert _dtype_mismatch_line(_raised(conversion)) == (
        "Tensor conversion requested dtype bfloat16 for Tensor with dtype float32"
    )
    assert _dtype_mismatch_line(_raised(unrelated_while_handling_a_dtype_error)) is None
    assert _dtype_mismatch_line(TypeError("Expected int32, got dtype float32 of argument 'x'.")) is None
    assert _dtype_mismatch_line(
        TypeError("Input 'y' of 'AddV2' Op has type float32 that does not match type bfloat16 of argument 'x'.")
    ) == "Input 'y' of 'AddV2' Op has type float32 that does not match type bfloat16 of argument 'x'."


def _snapshot(model):
    return {v.path: v.numpy().copy() for v in model.variables}


def test_gradient_check_changes_no_variable_of_a_model_with_batch_norm_and_dropout():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="hidden")(inputs)
    x = keras.layers.BatchNormalization(name="norm")(x)
    x = keras.layers.Dropout(0.5, name="drop")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out", dtype="float32")(x))
    batch = np.random.RandomState(0).normal(2.0, 3.0, (8, 4)).astype("float32")
    before = _snapshot(model)
    assert {"norm/moving_mean", "norm/moving_variance"} <= set(before)
    assert any("seed_generator" in path for path in before)
    report = tfmp.audit(model, batch=batch, tensor_cores=False)
    assert len(report.gradients) == len(model.trainable_variables)
    after = _snapshot(model)
    assert list(after) == list(before)
    for path, value in before.items():
        assert value.tobytes() == after[path].tobytes(), path  # bit-identical
    # The same forward without the restore does move the statistics.
    model(batch, training=True)
    assert not np.array_equal(model.get_layer("norm").moving_mean.numpy(), before["norm/moving_mean"])


def test_variables_are_restored_when_the_forward_raises():
    model = Net(SplitHeads(name="heads"))
    model.hidden.build((None, 4))
    model.norm.build((None, 8))
    before = _snapshot(model)
    assert len(before) == 6
    with pytest.raises(tf.errors.InvalidArgumentError):
        tfmp.audit(model, batch=np.full((8, 4), 5.0, "float32"), tensor_cores=False)
    after = _snapshot(model)
    assert all(before[path].tobytes() == after[path].tobytes() for path in before)


def test_model_built_by_the_gradient_check_keeps_its_initial_statistics():
    model = Net(keras.layers.Identity())
    assert model.variables == []
    tfmp.audit(model, batch=np.full((8, 4), 5.0, "float32"), tensor_cores=False)
    np.testing.assert_array_equal(model.norm.moving_mean.numpy(), np.zeros(8, "float32"))
    np.testing.assert_array_equal(model.norm.moving_variance.numpy(), np.ones(8, "float32"))


def test_gradient_check_lists_variable_and_gradient_dtypes():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = tfmp.force_float32(digits_model())
    before = [w.numpy().copy() for w in model.weights]
    report = tfmp.audit(model, batch=np.ones((8, 64), "float32"), tensor_cores=False)
    assert [g.path for g in report.gradients] == [v.path for v in model.trainable_variables]
    dtypes = {(g.variable_dtype, g.gradient_dtype) for g in report.gradients}
    assert dtypes == {("float32", "float32")}
    assert "Gradient check" in str(report)
    for old, new in zip(before, model.weights):
        np.testing.assert_array_equal(old, new.numpy())


def test_invalid_model():
    with pytest.raises(ValueError, match="Invalid `model` argument"):
        tfmp.audit(keras.layers.Dense(3))


@keras.saving.register_keras_serializable("tfmp_tests")
class _GanWithoutCall(keras.Model):
    """The keras.io DCGAN's shape: sublayers and a train_step, no call()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.layers.Dense(4)
        self.discriminator = keras.layers.Dense(1)

    def train_step(self, data):
        return {}


def test_a_failed_batch_pass_leaves_what_is_saved_unchanged(tmp_path):
    model = _GanWithoutCall()
    model.generator.build((None, 2))
    model.discriminator.build((None, 4))
    before = (model.built, model.get_build_config())
    with pytest.raises(NotImplementedError, match="call"):
        tfmp.audit(model, batch=np.ones((2, 2), "float32"))
    assert (model.built, model.get_build_config()) == before == (False, None)
    model.save(tmp_path / "gan.keras")
    loaded = keras.models.load_model(tmp_path / "gan.keras")
    assert type(loaded) is _GanWithoutCall and loaded.get_build_config() is None


class _BuildsThenFailsOnce(keras.Model):
    """A subclassed model whose build makes a weight and whose first call raises."""

    calls = 0

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 1), initializer="ones")

    def call(self, x):
        type(self).calls += 1
        if type(self).calls == 1:
            raise RuntimeError("first call fails")
        return x @ self.w


def test_a_batch_pass_that_built_state_before_failing_leaves_the_model_usable():
    model = _BuildsThenFailsOnce()
    with pytest.raises(RuntimeError, match="first call fails"):
        tfmp.audit(model, batch=np.ones((2, 3), "float32"))
    # Built before the failure: it stays built, and calls as plain Keras would.
    assert model.built and tuple(model.get_build_config()["input_shape"]) == (2, 3)
    np.testing.assert_array_equal(model(np.ones((2, 3), "float32")).numpy(), [[3.0], [3.0]])
