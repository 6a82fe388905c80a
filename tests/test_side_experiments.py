"""benchmarks/side_experiments.py: each subcommand runs (quick) and its numbers hang together; no timing asserts."""

import json
import math
import pathlib
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp._src.policy.enable import is_enabled

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness, side_experiments  # noqa: E402

# One worker runs this module (conftest.ONE_WORKER_MODULES), so its module fixtures run once.
# Research scripts, not tfmp: their quick runs (every experiment in mixed_bfloat16, 2-3
# minutes where bfloat16 is emulated) run with `-m slow`, outside README's command.
pytestmark = pytest.mark.slow

NAMES = tuple(side_experiments.EXPERIMENTS)
REWRITE_KEY = "auto_mixed_precision_onednn_bfloat16"
BF16 = "mixed_bfloat16"

# What each experiment times, written out: variant label -> the policy it runs
# (plain Keras and tfmp run mixed_bfloat16 in every experiment), in report order.
VARIANTS = {
    "xla": {"float32": "float32", BF16: BF16, "float32 + XLA": "float32",
            f"{BF16} + XLA": BF16},
    "onednn-rewrite": {BF16: BF16, f"{BF16} + rewrite": BF16, "float32": "float32",
                       "float32 + rewrite": "float32"},
    "cnn-without-bn": {"float32": "float32", BF16: BF16, "float32 without BN": "float32",
                       f"{BF16} without BN": BF16},
    "transformer-overhead": {"Keras": BF16, "tfmp": BF16, "Keras + guard": BF16,
                             "Keras + monitor": BF16, "tfmp again": BF16},
    "gelu": {"Keras": BF16, "tfmp": BF16, "tfmp, Keras's GELU": BF16,
             "ViT Keras": BF16, "ViT tfmp": BF16, "ViT tfmp, Keras's GELU": BF16},
    "cross-entropy": {"Keras": BF16, "tfmp": BF16, "tfmp, Keras's kernel": BF16},
    "bias-gradient": {"transformer summed": BF16, "transformer BiasAddGrad": BF16,
                      "vit summed": BF16, "vit BiasAddGrad": BF16},
    "bias-gradient-resnet50": {"resnet50 summed": BF16, "resnet50 BiasAddGrad": BF16,
                               "resnet50 summed with Conv2D": BF16},
}
# The speed ratios each experiment reports, (numerator, denominator), in order.
RATIOS = {
    "xla": [(f"{BF16} + XLA", "float32 + XLA"), (BF16, "float32"),
            ("float32 + XLA", "float32"), (f"{BF16} + XLA", BF16)],
    "onednn-rewrite": [(f"{BF16} + rewrite", BF16), ("float32 + rewrite", "float32"),
                       ("float32 + rewrite", BF16), (BF16, "float32")],
    "cnn-without-bn": [(f"{BF16} without BN", "float32 without BN"), (BF16, "float32")],
    "transformer-overhead": [("tfmp", "Keras"), ("Keras + guard", "Keras"),
                             ("Keras + monitor", "Keras"), ("tfmp again", "Keras"),
                             ("tfmp", "tfmp again")],
    "gelu": [("tfmp", "tfmp, Keras's GELU"), ("tfmp", "Keras"), ("tfmp, Keras's GELU", "Keras"),
             ("ViT tfmp", "ViT tfmp, Keras's GELU"), ("ViT tfmp", "ViT Keras"),
             ("ViT tfmp, Keras's GELU", "ViT Keras")],
    "cross-entropy": [("tfmp", "tfmp, Keras's kernel"), ("tfmp", "Keras"), ("tfmp, Keras's kernel", "Keras")],
    "bias-gradient": [("transformer summed", "transformer BiasAddGrad"), ("vit summed", "vit BiasAddGrad")],
    "bias-gradient-resnet50": [("resnet50 summed", "resnet50 BiasAddGrad"),
                               ("resnet50 summed with Conv2D", "resnet50 BiasAddGrad")],
}
# Medians and ratios are worked out with NumPy, not with the suite's statistics.median.


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Each subcommand run once with --quick through the command line, shared by the tests."""
    folder = tmp_path_factory.mktemp("side")
    policy_before = keras.config.dtype_policy().name
    out = {}
    for name in NAMES:
        path = folder / f"{name}.json"
        returned = side_experiments.main([name, "--quick", "--json", str(path)])
        out[name] = {"returned": returned, "written": json.loads(path.read_text(encoding="utf-8"))}
    out["policy"] = (policy_before, keras.config.dtype_policy().name)
    out["rewrite_option"] = tf.config.optimizer.get_experimental_options().get(REWRITE_KEY, False)
    return out


def test_subcommands_are_the_eight_experiments():
    assert NAMES == ("xla", "onednn-rewrite", "cnn-without-bn", "transformer-overhead", "gelu",
                     "cross-entropy", "bias-gradient", "bias-gradient-resnet50")
    assert set(VARIANTS) == set(RATIOS) == set(NAMES)


def test_runs_leave_no_global_state(quick):
    before, after = quick["policy"]
    assert after == before
    assert not is_enabled()
    assert quick["rewrite_option"] is False  # the Grappler option was set around calls only


@pytest.mark.parametrize("name", NAMES)
def test_json_holds_every_variant_and_its_samples(quick, name):
    written = quick[name]["written"]
    assert written == json.loads(json.dumps(quick[name]["returned"]))
    assert written["experiment"] == name and written["suite"]["quick"] is True
    assert written["suite"]["repeats"] == 2
    assert {label: v["policy"] for label, v in written["variants"].items()} == VARIANTS[name]
    assert list(written["variants"]) == list(VARIANTS[name])
    for label, variant in written["variants"].items():
        samples = variant["samples_per_s"]
        assert len(samples) == 2 and all(math.isfinite(s) and s > 0 for s in samples)
        # Two repeats: the median is their mean.
        assert variant["median_samples_per_s"] == pytest.approx((samples[0] + samples[1]) / 2)
    machine = written["machine"]
    assert len(machine["load_average_start"]) == len(machine["load_average_end"]) == 3
    assert machine["cpu"] and machine["date"]


@pytest.mark.parametrize("name", NAMES)
def test_ratios_are_medians_of_the_per_repeat_ratios(quick, name):
    written = quick[name]["written"]
    variants = written["variants"]
    assert list(written["ratios"]) == [f"{a} / {b}" for a, b in RATIOS[name]]
    for a, b in RATIOS[name]:
        ratio = written["ratios"][f"{a} / {b}"]
        sa, sb = (np.asarray(variants[v]["samples_per_s"]) for v in (a, b))
        assert (ratio["numerator"], ratio["denominator"]) == (a, b)
        assert ratio["paired"] == pytest.approx(np.median(sa / sb))
        assert ratio["value"] == pytest.approx(np.median(sa) / np.median(sb))


def test_batchnorm_share_is_one_minus_the_speed_ratio(quick):
    written = quick["cnn-without-bn"]["written"]
    shares = written["step_shares"]
    assert {label: (s["with"], s["without"]) for label, s in shares.items()} == {
        "BatchNormalization, float32 step": ("float32", "float32 without BN"),
        "BatchNormalization, mixed_bfloat16 step": (BF16, f"{BF16} without BN")}
    for share in shares.values():
        with_ = np.asarray(written["variants"][share["with"]]["samples_per_s"])
        without = np.asarray(written["variants"][share["without"]]["samples_per_s"])
        assert share["paired"] == pytest.approx(1 - np.median(with_ / without))
        assert share["value"] == pytest.approx(1 - np.median(with_) / np.median(without))
    # The quick CNN has 4 BatchNormalization layers; the variants without have none.
    layers = {label: v["fused_batchnorm"][1] for label, v in written["variants"].items()}
    assert layers == {"float32": 4, "mixed_bfloat16": 4, "float32 without BN": 0,
                      "mixed_bfloat16 without BN": 0}


def test_other_experiments_report_no_step_shares(quick):
    assert all(quick[n]["written"]["step_shares"] == {} for n in NAMES if n != "cnn-without-bn")


def test_xla_variants_compile_with_xla_and_the_others_without(quick):
    variants = quick["xla"]["written"]["variants"]
    assert {label: v["jit_compile"] for label, v in variants.items()} == {
        "float32": False, "mixed_bfloat16": False, "float32 + XLA": True,
        "mixed_bfloat16 + XLA": True}


def test_transformer_variants_differ_in_optimizer_and_monitor_only(quick):
    variants = quick["transformer-overhead"]["written"]["variants"]
    facts = {label: (v["config"], v["optimizer"], v["monitor"]) for label, v in variants.items()}
    assert facts == {
        "Keras": ("keras_mixed", "Adam", False),
        "tfmp": ("tfmp", "LossScaleOptimizer", True),
        "Keras + guard": ("keras_mixed", "LossScaleOptimizer", False),
        "Keras + monitor": ("keras_mixed", "Adam", True),
        "tfmp again": ("tfmp", "LossScaleOptimizer", True),
    }
    assert variants["tfmp"]["overrides"] == variants["tfmp again"]["overrides"]
    assert variants["tfmp"]["overrides"]["tfmp_policy"] == "mixed_bfloat16"


def test_gelu_variants_differ_in_the_gelu_decision_only(quick):
    variants = quick["gelu"]["written"]["variants"]
    decisions = {label: v["gelu"].split(":")[0] for label, v in variants.items()}
    assert decisions == {"Keras": "keras (not attached)", "tfmp": "float32 inside",
                         "tfmp, Keras's GELU": "keras", "ViT Keras": "keras (not attached)",
                         "ViT tfmp": "float32 inside", "ViT tfmp, Keras's GELU": "keras"}
    assert all(v["gelu"].endswith(": set by the side experiment")
               for label, v in variants.items() if "tfmp" in label)
    for model in ("", "ViT "):
        ours, theirs = variants[f"{model}tfmp"]["overrides"], variants[f"{model}tfmp, Keras's GELU"]["overrides"]
        assert (ours.pop("gelu_float32_inside"), theirs.pop("gelu_float32_inside")) == (True, False)
        assert ours == theirs


def test_cross_entropy_variants_differ_in_the_cross_entropy_feature_only(quick):
    variants = quick["cross-entropy"]["written"]["variants"]
    decisions = {label: v["cross_entropy"] for label, v in variants.items()}
    assert decisions["Keras"] == "keras (not attached)"
    assert decisions["tfmp"].startswith("float32 inside: ")  # the quick decoder, on this CPU
    assert decisions["tfmp, Keras's kernel"] == "keras: speed-up off (tfmp.enable(speedups=...))"
    ours, theirs = dict(variants["tfmp"]["overrides"]), dict(variants["tfmp, Keras's kernel"]["overrides"])
    assert (ours.pop("speedups_off"), theirs.pop("speedups_off")) == ([], ["cross_entropy"])
    assert ours == theirs


@pytest.mark.parametrize("name", ["bias-gradient", "bias-gradient-resnet50"])
def test_bias_gradient_variants_differ_in_the_bias_gradient_decision_only(quick, name):
    variants = quick[name]["written"]["variants"]
    expected = {"summed": "summed except after Conv2D: ", "BiasAddGrad": "keras: ", "with Conv2D": "summed: "}
    for label, v in variants.items():
        assert v["bias_gradient"].startswith(expected[label.split(" ", 1)[1].replace("summed ", "")])
        assert "injected" in v["bias_gradient"]
    for ours, theirs in zip(list(variants.values())[:4:2], list(variants.values())[1:4:2]):
        ours, theirs = dict(ours["overrides"]), dict(theirs["overrides"])
        assert (ours.pop("bias_gradient_summed"), theirs.pop("bias_gradient_summed")) == (True, False)
        assert ours == theirs
    if name == "bias-gradient-resnet50":  # the quick suite has no ResNet50: its quick CNN stands in
        assert all(v["workload"].startswith("CNN") for v in variants.values())


def test_rewrite_variants_carry_the_grappler_option(quick):
    written = quick["onednn-rewrite"]["written"]
    assert isinstance(written["rewrite_applies"], bool)
    options = {label: v["overrides"]["grappler"] for label, v in written["variants"].items()}
    assert options == {"mixed_bfloat16": None, "mixed_bfloat16 + rewrite": {REWRITE_KEY: True},
                       "float32": None, "float32 + rewrite": {REWRITE_KEY: True}}
    assert all("rewrite_applies" not in quick[n]["written"] for n in NAMES if n != "onednn-rewrite")


def test_markdown_names_every_variant_and_ratio(quick):
    for name in NAMES:
        text = side_experiments.markdown(quick[name]["written"])
        for label in quick[name]["written"]["variants"]:
            assert f"| {label} |" in text
        for label in quick[name]["written"]["ratios"]:
            assert f"| {label} |" in text
        assert "load average" in text


def test_grappler_options_are_restored_after_the_call():
    before = tf.config.optimizer.get_experimental_options().get(REWRITE_KEY, False)
    with harness.grappler_options({REWRITE_KEY: True}):
        assert tf.config.optimizer.get_experimental_options()[REWRITE_KEY] is True
    assert tf.config.optimizer.get_experimental_options().get(REWRITE_KEY, False) is before
    with harness.grappler_options(None):  # nothing set
        assert tf.config.optimizer.get_experimental_options().get(REWRITE_KEY, False) is before


def test_a_function_run_under_the_rewrite_is_exact_again_outside():
    # The probe calls one tf.function with and without the option: the later call
    # without it must compute in float32 again (the option is per call, not sticky).
    a = tf.random.stateless_normal((32, 32), seed=(5, 6))
    product = tf.function(lambda x: tf.matmul(x, x))
    exact = product(a).numpy()
    with harness.grappler_options({REWRITE_KEY: True}):
        product(a)
    assert (product(a).numpy() == exact).all()


@pytest.mark.parametrize("argv", [["xla", "--repeats", "0"], [], ["unknown"]])
def test_bad_command_lines_exit_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        side_experiments.main(argv)
    assert raised.value.code == 2
