"""The line tfmp prints at compile: what it did to the model, from its attachment."""

import keras
import numpy as np
import pytest

import tfmp

# float16 has no arithmetic on this CPU; the float16 case only compiles.
pytestmark = pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")

BF16_WRAPPED = ("optimizer tfmp.LossScaleOptimizer(Adam): no loss scaling (fixed scale 1.0), "
                "guard='auto', fused updates on")


def classifier():
    """Functional Dense -> Dense -> Softmax, the Softmax the model's output."""
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="hidden")(inputs)
    x = keras.layers.Dense(3, name="logits")(x)
    return keras.Model(inputs, keras.layers.Softmax(name="probs")(x), name="clf")


def compiled_output(capsys, policy, optimizer="adam", **options):
    """What compiling `classifier()` under `policy` printed, and the model."""
    capsys.readouterr()
    with tfmp.policy_scope(policy, **options):
        model = classifier()
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return capsys.readouterr().out, model


@pytest.mark.parametrize("policy, optimizer", [
    ("mixed_bfloat16", BF16_WRAPPED),
    ("mixed_float16", "optimizer tfmp.LossScaleOptimizer(Adam): dynamic loss scale, guard='auto', "
                      "fused updates on"),
])
def test_the_line_of_a_16bit_functional_model(capsys, policy, optimizer):
    out, model = compiled_output(capsys, policy)
    assert out == (f"tfmp: model 'clf' compiled under {policy}; 1 layer forced to float32: "
                   f"probs (model output); {optimizer}\n")
    # What it says is what the model computes in and trains with.
    assert model.get_layer("probs").dtype_policy.name == "float32"
    assert model.get_layer("logits").dtype_policy.name == policy
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
    assert model.optimizer.loss_scaling is (policy == "mixed_float16")


def test_float32_leaves_the_optimizer_alone(capsys):
    out, model = compiled_output(capsys, "float32")
    assert out == ("tfmp: model 'clf' compiled under float32; no layer forced to float32; "
                   "optimizer Adam left alone (float32 compute)\n")
    assert type(model.optimizer) is keras.optimizers.Adam


def test_compiled_without_optimizer(capsys):
    out, model = compiled_output(capsys, "mixed_bfloat16", optimizer=None)
    assert out.endswith("float32: probs (model output); no optimizer\n")
    assert model.optimizer is None


def test_debug_says_check_numerics(capsys):
    out, _ = compiled_output(capsys, "mixed_bfloat16", debug=True)
    assert out.endswith("guard='gradients', fused updates on; check_numerics on\n")


def test_many_forced_layers_are_counted_by_reason(capsys):
    capsys.readouterr()
    with tfmp.policy_scope("mixed_bfloat16", keep_float32=[keras.layers.Dense]):
        model = keras.Sequential(
            [keras.Input((4,))] + [keras.layers.Dense(4, name=f"d{i}") for i in range(5)]
            + [keras.layers.Softmax(name="sm"), keras.layers.LayerNormalization(name="ln")], name="deep")
        model.compile(optimizer="sgd", loss="mse")
    out = capsys.readouterr().out
    assert out.startswith("tfmp: model 'deep' compiled under mixed_bfloat16; 7 layers forced to "
                          "float32: 5 user rule, 1 softmax, 1 model output (first: d0, d1, d2, ...); "
                          "optimizer tfmp.LossScaleOptimizer(SGD): ")
    assert {layer.name for layer in model.layers if layer.dtype_policy.name == "float32"} == {
        "d0", "d1", "d2", "d3", "d4", "sm", "ln"}


def test_quiet_prints_nothing(capsys):
    out, model = compiled_output(capsys, "mixed_bfloat16", verbose=False)
    assert out == ""
    # Quiet changes what is printed, not what is done.
    assert tfmp.attachment(model).forced_float32 == {"probs": "output"}
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)


def test_once_per_compile_again_only_when_it_changed(capsys):
    x, y = np.ones((8, 4), "float32"), np.zeros((8,), "int32")
    capsys.readouterr()
    with tfmp.policy_scope("mixed_bfloat16"):
        model = classifier()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        [first] = capsys.readouterr().out.splitlines()
        model.fit(x, y, epochs=2, verbose=0)
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
        assert capsys.readouterr().out == ""  # fit and the same decisions again: silent
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        [again] = capsys.readouterr().out.splitlines()
    assert first == f"tfmp: model 'clf' compiled under mixed_bfloat16; 1 layer forced to float32: probs " \
                    f"(model output); {BF16_WRAPPED}"
    assert again == first.replace("(Adam)", "(SGD)")


def test_a_model_loaded_while_enabled_prints_nothing(capsys, tmp_path):
    with tfmp.policy_scope("mixed_bfloat16", verbose=False):
        model = classifier()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    path = str(tmp_path / "clf.keras")
    model.save(path)
    capsys.readouterr()
    with tfmp.policy_scope("mixed_bfloat16"):
        loaded = keras.models.load_model(path)
    assert capsys.readouterr().out == ""
    assert tfmp.attachment(loaded).attached_by == "load"
