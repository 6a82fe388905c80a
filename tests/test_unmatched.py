"""A keep/exclude target matching no layer of its model warns (tfmp/_src/float32/unmatched.py)."""

import warnings
import weakref

import keras
import numpy as np
import pytest
from _collect import collect_everything

import tfmp

pytestmark = pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")  # 16 bits emulated on CPUs


def classifier(policy="mixed_float16"):
    keras.config.set_dtype_policy(policy)
    return keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, name="proj"), keras.layers.Softmax(name="softmax"),
        keras.layers.Dense(2, name="head"),
    ], name="classifier")


def unmatched(caught):
    """Messages of the `tfmp.UnmatchedTargetWarning`s among ``caught``, without their guide line."""
    return [str(w.message).rsplit("\nGuide: ", 1)[0] for w in caught
            if issubclass(w.category, tfmp.UnmatchedTargetWarning)]


def test_a_misspelt_exclude_pattern_warns_with_the_pattern_and_a_close_one():
    model = classifier()
    with pytest.warns(tfmp.UnmatchedTargetWarning) as caught:
        tfmp.force_float32(model, exclude=["*softmx"])
    assert unmatched(caught) == [
        "A target in `exclude` matches no layer of model 'classifier'. Received: exclude='*softmx'.\n"
        "Expected a layer-path glob pattern, such as 'proj', 'softmax', 'head' (3 layers); "
        "tfmp.audit(model) lists them.\n"
        "Did you mean '*softmax'?"
    ]
    assert caught[0].filename == __file__  # points at the call above
    assert model.get_layer("softmax").compute_dtype == "float32"  # the exclusion changed nothing


def test_a_class_target_matching_no_layer_warns_with_the_model_classes():
    model = classifier()
    with pytest.warns(tfmp.UnmatchedTargetWarning) as caught:
        tfmp.force_float32(model, keep=[keras.layers.Attention, "proj"])
    [message] = unmatched(caught)
    assert "A target in `keep` matches no layer of model 'classifier'" in message
    assert f"Received: keep={keras.layers.Attention!r}." in message
    assert "a Layer class the model uses, such as Dense, Softmax (3 layers)" in message
    assert message.endswith("Pass a class the model uses, or a layer-path pattern.")
    assert model.get_layer("proj").compute_dtype == "float32"  # the matching target applies


def test_a_class_name_given_as_a_string_is_told_to_pass_the_class():
    model = classifier()
    with pytest.warns(tfmp.UnmatchedTargetWarning) as caught:
        tfmp.force_float32(model, exclude=["Dense"])
    [message] = unmatched(caught)
    assert "Received: exclude='Dense'." in message
    assert message.endswith("A string is a layer-path pattern; 'Dense' names a class. Pass the "
                            "class itself: keras.layers.Dense.")


def test_matching_targets_and_registered_ones_do_not_warn():
    model = classifier()
    with warnings.catch_warnings(), tfmp.register_float32("*not_in_this_model*"), \
            tfmp.register_float32(keras.layers.Attention, exclude=True):
        warnings.simplefilter("error", tfmp.UnmatchedTargetWarning)
        tfmp.force_float32(model, keep=["pro*", keras.layers.Dense], exclude=[keras.layers.Softmax, "head"])
    dtypes = {layer.name: layer.compute_dtype for layer in model.layers}
    assert dtypes == {"proj": "float32", "softmax": "float16", "head": "float16"}


def test_once_per_model_and_target():
    model = classifier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tfmp.force_float32(model, exclude="haed")
        tfmp.force_float32(model, exclude="haed")
        tfmp.force_float32(model, exclude=["haed", "*nothing"])
        tfmp.force_float32(classifier(), exclude="haed")
    found = unmatched(caught)
    assert [m.split("Received: ")[1].split(".")[0] for m in found] == [
        "exclude='haed'", "exclude='*nothing'", "exclude='haed'"]
    assert found[0].endswith("Did you mean 'head'?")
    assert "Correct the pattern to match a layer path, or leave it out." in found[1]


class Block(keras.layers.Layer):
    """A custom layer whose sublayer exists only after ``build``."""

    def build(self, input_shape):
        self.probs = keras.layers.Dense(input_shape[-1], activation="softmax", name="inner_probs")
        self.probs.build(input_shape)

    def call(self, x):
        return self.probs(x) + x


class Lazy(keras.Model):
    """Subclassed model, unbuilt: the rules reach ``block/inner_probs`` and MHA's softmax at build."""

    def __init__(self):
        super().__init__(name="lazy")
        self.block = Block(name="block")
        self.mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")
        self.out = keras.layers.Dense(2, name="out")

    def call(self, x):
        return self.out(self.mha(self.block(x), x))


def test_targets_matching_layers_built_later_do_not_warn():
    keras.config.set_dtype_policy("mixed_float16")
    model = Lazy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfmp.UnmatchedTargetWarning)
        tfmp.force_float32(model, exclude=["*inner_probs", "mha/softmax"])
        model(np.ones((1, 3, 8), "float32"))
    assert model.block.probs.compute_dtype == "float16"  # excluded once it existed
    assert model.mha._softmax.compute_dtype == "float16"


def test_a_model_with_unbuilt_layers_is_judged_once_they_are_built():
    keras.config.set_dtype_policy("mixed_float16")
    model = Lazy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tfmp.force_float32(model, exclude=["*inner_probs", "*inner_prbs"])
        assert unmatched(caught) == []  # block/inner_probs does not exist yet
        model(np.ones((1, 3, 8), "float32"))
    [message] = unmatched(caught)
    assert "Received: exclude='*inner_prbs'." in message and message.endswith("Did you mean '*inner_probs'?")
    assert "'block', 'mha', 'out'" in message


class Wrapper(keras.Model):
    """Subclassed model, unbuilt, without a ``build`` of its own, around a built layer."""

    def __init__(self):
        super().__init__(name="wrapper")
        self.dense = keras.layers.Dense(2, name="dense")
        self.dense.build((None, 4))

    def call(self, x):
        return self.dense(x)


def test_a_model_whose_build_creates_nothing_is_judged_at_once():
    keras.config.set_dtype_policy("mixed_float16")
    model = Wrapper()
    assert not model.built
    with pytest.warns(tfmp.UnmatchedTargetWarning, match=r"(?s)exclude='dnse'\..*\nDid you mean 'dense'\?"):
        tfmp.force_float32(model, exclude="dnse")


def test_a_pending_judgement_does_not_keep_the_model_alive():
    keras.config.set_dtype_policy("mixed_float16")
    model = Lazy()
    tfmp.force_float32(model, exclude="*inner_prbs")  # never built: never judged
    model_ref, block_ref = weakref.ref(model), weakref.ref(model.block)
    del model
    keras.backend.clear_session()
    collect_everything()
    assert model_ref() is None and block_ref() is None


def test_session_targets_warn_at_compile_under_their_own_names():
    with tfmp.policy_scope("mixed_bfloat16", exclude_float32="*softmx"):
        model = classifier("mixed_bfloat16")
        with pytest.warns(tfmp.UnmatchedTargetWarning) as caught:
            model.compile("sgd", "mse")
        with warnings.catch_warnings():
            warnings.simplefilter("error", tfmp.UnmatchedTargetWarning)
            model.compile("sgd", "mse")  # the same model: said once
    [message] = unmatched(caught)
    assert "A target in `exclude_float32` matches no layer of model 'classifier'" in message
    assert "Received: exclude_float32='*softmx'." in message
    assert message.endswith("Did you mean '*softmax'? Or tfmp.register_float32 it: not checked per model.")
    assert caught[0].filename == __file__  # the compile() call


def flat_names():
    """Layer names as keras.applications gives them: flat, numbered, BatchNormalization as ``_BN``."""
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8, 8, 3))
    x = inputs
    for block in (1, 2, 16):
        x = keras.layers.DepthwiseConv2D(3, padding="same", name=f"block_{block}_depthwise")(x)
        x = keras.layers.BatchNormalization(name=f"block_{block}_depthwise_BN")(x)
        x = keras.layers.ReLU(name=f"block_{block}_depthwise_relu")(x)
    return keras.Model(inputs, keras.layers.GlobalAveragePooling2D(name="pool")(x), name="flat")


@pytest.mark.parametrize("target, fix", [
    ("block_1_depthwise_bn", "Did you mean 'block_1_depthwise_BN'? (Patterns are case-sensitive.)"),
    ("*depthwise_bn", "Patterns are case-sensitive: ignoring case it would match 3 layers, "
                      "e.g. 'block_1_depthwise_BN'."),
    ("*depthwise_BM", "Did you mean '*depthwise_BN'?"),  # a glob like the one typed, matching all three
    ("block_17_*", "Did you mean 'block_1_*'?"),  # a glob again (block_1's three layers), not one name
])
def test_suggestions_on_flat_names_keep_the_case_and_the_shape_of_the_pattern(target, fix):
    model = flat_names()
    with pytest.warns(tfmp.UnmatchedTargetWarning) as caught:
        tfmp.force_float32(model, exclude=[target])
    [message] = unmatched(caught)
    assert f"Received: exclude={target!r}.\n" in message and message.endswith(f"\n{fix}")
