"""The benchmark suite runs (quick mode) and its numbers hang together; no timing asserts."""

import json
import math
import pathlib
import sys

import keras
import numpy as np
import pytest
from _events import read_run

import tfmp
from tfmp._src.policy.enable import is_enabled

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import guard_cost, harness, memory, report, run  # noqa: E402

# One worker runs this module (conftest.ONE_WORKER_MODULES), so its module fixtures run once.

# The models of the quick run: a Dense stack, the BatchNormalization CNN and the
# two-output decoder cover every path of the harness; the Transformer and the ViT
# are built in test_real_models_are_written_as_keras_io_writes_them.
MODELS = {"mlp", "cnn", "decoder"}
# The BatchNormalization comparison runs "auto"'s mixed policy, or emulated
# mixed_bfloat16 where "auto" keeps float32.
BATCHNORM_POLICY = {"float32": "mixed_bfloat16", "mixed_bfloat16": "mixed_bfloat16",
                    "mixed_float16": "mixed_float16"}

# Medians and ratios below are worked out with NumPy, not with the suite's own
# statistics.median: a wrong sample list or a wrong pairing shows.


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One quick run of the whole suite through its command line, shared by the tests."""
    folder = tmp_path_factory.mktemp("bench")
    json_path = folder / "results.json"
    policy_before = keras.config.dtype_policy().name
    results = run.main(["--quick", "--json", str(json_path), "--log-dir", str(folder / "logs"),
                        "--models", *sorted(MODELS)])
    policy_after = keras.config.dtype_policy().name
    written = json.loads(json_path.read_text(encoding="utf-8"))
    return dict(results=results, written=written, folder=folder,
                policy_before=policy_before, policy_after=policy_after)


def test_quick_run_leaves_no_global_state(quick):
    assert quick["policy_after"] == quick["policy_before"]
    assert not is_enabled()
    assert "compile" not in keras.Model.__dict__


def test_json_holds_every_model_and_config(quick, capsys):
    results = quick["written"]
    assert results == json.loads(json.dumps(quick["results"]))
    assert set(results["models"]) == MODELS
    decision = tfmp.recommend_policy()  # "auto" itself: tested against the CPU in test_hardware.py
    assert results["decision"]["policy"] == decision.policy
    for name, model in results["models"].items():
        assert set(model["configs"]) == set(harness.CONFIGS), name
        policies = {c: model["configs"][c]["policy"] for c in harness.CONFIGS}
        assert policies == {"float32": "float32", "keras_mixed": decision.policy,
                            "tfmp": decision.policy}
        assert model["steps_per_repeat"] >= 1


def test_samples_per_second_are_positive_and_medians_match(quick):
    repeats = quick["written"]["suite"]["repeats"]
    for model in quick["written"]["models"].values():
        for config in model["configs"].values():
            samples = config["samples_per_s"]
            assert len(samples) == repeats
            assert all(math.isfinite(s) and s > 0 for s in samples)
            assert config["median_samples_per_s"] == pytest.approx(float(np.median(samples)))
            assert config["min_samples_per_s"] == min(samples)
            assert config["max_samples_per_s"] == max(samples)
            assert config["min_samples_per_s"] <= config["median_samples_per_s"]
            assert config["median_samples_per_s"] <= config["max_samples_per_s"]


def test_ratios_are_computed_from_the_medians(quick):
    for model in quick["written"]["models"].values():
        sps = {k: np.asarray(c["samples_per_s"]) for k, c in model["configs"].items()}
        med = {k: np.median(v) for k, v in sps.items()}
        r = model["ratios"]
        for name, (a, b) in {"keras_mixed_vs_float32": ("keras_mixed", "float32"),
                             "tfmp_vs_float32": ("tfmp", "float32"),
                             "tfmp_vs_keras_step_time": ("keras_mixed", "tfmp")}.items():
            assert r[name]["value"] == pytest.approx(med[a] / med[b]), name
            assert r[name]["paired"] == pytest.approx(np.median(sps[a] / sps[b])), name
            assert r[name]["fastest"] == pytest.approx(sps[a].max() / sps[b].max()), name


def test_ceiling_fraction_divides_the_speed_up_by_the_matmul_ratio(quick):
    mm = quick["written"]["matmul"]
    gflops = {d: np.asarray(c["gflops"]) for d, c in mm["configs"].items()}
    mine, f32 = gflops[mm["dtype"]], gflops["float32"]
    ceiling = {"value": np.median(mine) / np.median(f32), "paired": np.median(mine / f32),
               "fastest": mine.max() / f32.max()}
    assert mm["ratio"]["fastest"] == pytest.approx(ceiling["fastest"])
    for name, model in quick["written"]["models"].items():
        sps = {k: np.asarray(c["samples_per_s"]) for k, c in model["configs"].items()}
        speed_up = {"value": np.median(sps["tfmp"]) / np.median(sps["float32"]),
                    "paired": np.median(sps["tfmp"] / sps["float32"]),
                    "fastest": sps["tfmp"].max() / sps["float32"].max()}
        fraction = model["ratios"]["tfmp_vs_float32_of_ceiling"]
        for form in ("value", "paired", "fastest"):
            assert fraction[form] == pytest.approx(speed_up[form] / ceiling[form]), (name, form)


def test_roofline_comes_from_each_models_float32_profile(quick):
    mm = quick["written"]["matmul"]["ratio"]
    text = report.markdown(quick["written"])
    assert "| roofline | tfmp / float32 of roofline |" in text
    for name, model in quick["written"]["models"].items():
        profile = model["roofline"]
        assert profile["steps"] == quick["written"]["suite"]["roofline_steps"] == 2
        shares = profile["shares"]
        assert sum(shares.values()) == pytest.approx(1.0) and shares["matmul"] > 0, name
        kept = shares["optimizer"] + shares["host"]
        assert profile["split"] == pytest.approx(
            {"matmul": shares["matmul"], "halved": 1.0 - shares["matmul"] - kept, "kept": kept})
        speed_up = model["ratios"]["tfmp_vs_float32"]
        for form in ("value", "paired", "fastest"):
            # Matmuls at the ceiling (never below float32 speed), the rest of the ops at half time.
            ideal = 1.0 / (shares["matmul"] / max(mm[form], 1.0) + (1.0 - shares["matmul"] - kept) / 2 + kept)
            assert profile["speed_up"][form] == pytest.approx(ideal), (name, form)
            assert model["ratios"]["tfmp_vs_float32_of_roofline"][form] == pytest.approx(
                speed_up[form] / ideal), (name, form)
        fraction = model["ratios"]["tfmp_vs_float32_of_roofline"]
        assert f"| {profile['speed_up']['paired']:.2f}x | {fraction['paired']:.0%} / {fraction['fastest']:.0%} |" \
            in text, name
        assert f"- {name}: matmul/conv {profile['split']['matmul']:.0%}" in text


def test_machine_names_the_cpu_flags_of_proc_cpuinfo(quick):
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    wanted = ["avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx2", "f16c"]
    assert quick["written"]["machine"]["cpu_flags"] == [f for f in wanted if f in flags]
    line = report.machine_line(quick["written"]["machine"], 1.0)
    assert all(f in line for f in quick["written"]["machine"]["cpu_flags"])
    isa = quick["written"]["machine"]["onednn_isa"]  # read in a child, as tfmp doctor reads it
    assert isa["source"] == "measured" and f"oneDNN matmul ISA: {isa['label']}" in line


def test_real_models_are_written_as_keras_io_writes_them():
    from benchmarks import real_models

    keras.config.set_dtype_policy("float32")  # the conftest fixture restores it
    chosen = run.workloads(quick=True)
    assert set(chosen) == MODELS | {"transformer", "vit"}
    transformer = chosen["transformer"].build()
    assert transformer.output.shape == (None, 2) and len(transformer.trainable_weights) > 10
    vit = chosen["vit"].build()
    kinds = [type(layer).__name__ for layer in vit.layers]
    # The quick ViT: 1 block; its head 16-8 (Dense+GELU+Dropout each), then 10 logits.
    assert kinds[:3] == ["InputLayer", "Patches", "PatchEncoder"]
    assert kinds.count("MultiHeadAttention") == 1 and kinds.count("LayerNormalization") == 3
    assert kinds[-7:] == ["Flatten", "Dropout", "Dense", "Dropout", "Dense", "Dropout", "Dense"]
    assert vit.output.shape == (None, 10)
    decoder = chosen["decoder"].build()
    assert [type(layer).__name__ for layer in decoder.layers] == [
        "InputLayer", "TokenAndPositionEmbedding", "TransformerBlock", "Dense"]
    # Outputs [logits, x]: (batch, 8 tokens, 50 words) and (batch, 8, 16); loss on the logits only.
    assert [tuple(o.shape) for o in decoder.outputs] == [(None, 8, 50), (None, 8, 16)]
    loss = chosen["decoder"].compile_loss()
    assert isinstance(loss[0], keras.losses.SparseCategoricalCrossentropy) and loss[1] is None
    x, y = chosen["decoder"].inputs(8, np.random.default_rng(0))
    assert x.shape == y.shape == (32, 8) and (x[:, 1:] == y[:, :-1]).all()  # next-token labels
    # The causal mask of 3 positions: each attends to itself and the ones before.
    mask = keras.ops.convert_to_numpy(real_models.causal_attention_mask(2, 3, 3, "int32"))
    assert mask.tolist() == [[[1, 0, 0], [1, 1, 0], [1, 1, 1]]] * 2
    # keras.io's timeseries classifier: 3 x (Conv1D + BatchNormalization + ReLU), pooling, softmax.
    series = real_models.timeseries(length=12, filters=4, classes=3, batch_size=2)
    kinds = [type(layer).__name__ for layer in series.build().layers]
    assert kinds == ["InputLayer", *["Conv1D", "BatchNormalization", "ReLU"] * 3, "GlobalAveragePooling1D", "Dense"]
    x, y = series.inputs(2, np.random.default_rng(0))
    assert x.shape == (8, 12, 1) and y.shape == (8,) and series.compile_loss() == "sparse_categorical_crossentropy"


def test_keras_hub_models_take_their_tasks_inputs_and_give_logits_per_token():
    pytest.importorskip("keras_hub")
    from benchmarks import hub_models

    keras.config.set_dtype_policy("float32")  # the conftest fixture restores it
    for workload, task in ((hub_models.gpt2(50, 1, 2, 8, 6, 2), "GPT2CausalLM"),
                           (hub_models.bart(50, 1, 2, 8, 6, 2), "BartSeq2SeqLM")):
        model = workload.build()
        assert type(model).__name__ == task
        x, y = workload.inputs(2, np.random.default_rng(0))
        assert all(v.shape == (8, 6) for v in x.values()) and y.shape == (8, 6)
        logits = model({k: v[:2] for k, v in x.items()})
        # Untrained logits over 50 tokens: the loss is near log(50).
        loss = float(workload.compile_loss()(y[:2], logits))
        assert logits.shape == (2, 6, 50) and abs(loss - np.log(50)) < 0.5, (task, loss)


def test_batchnorm_line_compares_keras_and_fused_kernels(quick):
    decision = tfmp.recommend_policy()
    section = quick["written"]["batchnorm"]
    assert section["policy"] == BATCHNORM_POLICY[decision.policy]
    assert set(section["models"]) == {"cnn"}  # resnet50 runs at full size only
    cnn = section["models"]["cnn"]
    assert set(cnn["configs"]) == set(harness.BN_CONFIGS)
    assert {c["policy"] for c in cnn["configs"].values()} == {section["policy"]}
    # The quick CNN has 4 BatchNormalization layers: all fused in fused_bn, none in plain Keras.
    assert cnn["configs"]["fused_bn"]["fused_batchnorm"] == [4, 4]
    assert cnn["configs"]["keras_mixed"]["fused_batchnorm"] == [0, 4]
    # The suite's tfmp configuration traces while enabled: fused exactly when "auto" is mixed.
    tfmp_cnn = quick["written"]["models"]["cnn"]["configs"]["tfmp"]
    assert tfmp_cnn["fused_batchnorm"] == [4 if decision.policy.startswith("mixed_") else 0, 4]
    med = {k: np.median(c["samples_per_s"]) for k, c in cnn["configs"].items()}
    assert cnn["ratios"]["fused_vs_keras"]["value"] == pytest.approx(med["fused_bn"] / med["keras_mixed"])
    assert "Keras BatchNormalization vs fused" in report.markdown(quick["written"])


def test_batchnorm_only_skips_the_main_section():
    results = run.run_suite(quick=True, repeats=1, models=["mlp"], batchnorm_only=True)
    assert results["models"] == {} and results["targets"] == []
    assert results["batchnorm"]["models"] == {}  # the MLP has no BatchNormalization
    assert results["batchnorm"]["policy"] == BATCHNORM_POLICY[tfmp.recommend_policy().policy]


def test_matmul_ceiling_is_measured_in_float32_and_the_recommended_dtype(quick):
    mm = quick["written"]["matmul"]
    assert mm["dtype"] == tfmp.recommend_policy().compute_dtype
    assert set(mm["configs"]) == {"float32", mm["dtype"]}
    gflops = {d: np.asarray(c["gflops"]) for d, c in mm["configs"].items()}
    for dtype, config in mm["configs"].items():
        assert len(gflops[dtype]) == quick["written"]["suite"]["repeats"]
        assert all(g > 0 for g in gflops[dtype])
        assert config["median_gflops"] == pytest.approx(np.median(gflops[dtype]))
    mine, f32 = gflops[mm["dtype"]], gflops["float32"]
    assert mm["ratio"]["value"] == pytest.approx(np.median(mine) / np.median(f32))
    assert mm["ratio"]["paired"] == pytest.approx(np.median(mine / f32))


def test_memory_counts_follow_the_policies(quick):
    mixed = tfmp.recommend_policy().compute_dtype != "float32"
    for name, model in quick["written"]["models"].items():
        mem = {k: c["memory"] for k, c in model["configs"].items()}
        # Mixed policies keep float32 master weights: same parameter bytes.
        assert len({m["parameter_bytes"] for m in mem.values()}) == 1, name
        assert len({m["gradient_bytes"] for m in mem.values()}) == 1, name
        assert all(m["activation_bytes"] > 0 for m in mem.values())
        if mixed:
            # tfmp's LossScaleOptimizer adds its scale and counters to Adam's slots.
            assert mem["tfmp"]["optimizer_bytes"] > mem["keras_mixed"]["optimizer_bytes"]
            assert mem["keras_mixed"]["activation_bytes"] < mem["float32"]["activation_bytes"]
            # Outputs and normalization forced to float32 cost some of the saving.
            assert (mem["keras_mixed"]["activation_bytes"]
                    <= mem["tfmp"]["activation_bytes"]
                    < mem["float32"]["activation_bytes"])
        else:  # "auto" is float32 here: tfmp leaves Adam alone, nothing is added
            assert mem["tfmp"]["optimizer_bytes"] == mem["float32"]["optimizer_bytes"]
        if not quick["written"]["machine"]["gpus"]:
            assert all(m["peak_device_bytes"] is None for m in mem.values())


def test_targets_are_judged_from_the_ratios(quick):
    results = quick["written"]
    targets = results["targets"]
    overhead = [t for t in targets if t["limit"] == 1.02]
    assert {t["model"] for t in overhead} == MODELS
    for t in targets:
        value = results["models"][t["model"]]["ratios"][t["ratio"]]["paired"]
        assert t["value"] == value
        if t["met"] is not None:
            assert t["met"] == (value <= t["limit"] if t["op"] == "<=" else value >= t["limit"])


def test_tfmp_config_ran_with_the_monitor(quick):
    # Quick mode: one warm-up fit call and 2 timed ones, each an epoch of 2-3
    # steps, under update_freq=100: one epoch point per call, no batch points. One
    # monitor serves every call, so the epoch axis continues: epochs 0, 1, 2 (one
    # event file per call, read in any order).
    calls = 1 + quick["written"]["suite"]["repeats"]
    for name in MODELS:
        run = read_run(quick["folder"] / "logs" / name)
        assert sorted(step for step, _ in run["precision/epoch_loss_scale"]) == [0, 1, 2] == list(range(calls)), name
        assert "precision/batch_loss_scale" not in run, name


def test_printed_report_names_every_model(quick, capsys):
    text = report.markdown(quick["written"])
    for name in MODELS:
        assert f"| {name} |" in text
    if not quick["written"]["machine"]["gpus"]:
        assert "n/a on CPU" in text


def test_ratios_and_verdicts_on_exact_numbers(quick):
    configs = {
        "float32": report.summarize_config([100.0, 200.0, 100.0]),
        "keras_mixed": report.summarize_config([200.0, 400.0, 200.0]),
        "tfmp": report.summarize_config([400.0, 200.0, 200.0]),
    }
    r = report.ratios(configs)
    assert r["keras_mixed_vs_float32"] == {"value": 2.0, "paired": 2.0, "fastest": 2.0}
    assert r["tfmp_vs_float32"] == {"value": 2.0, "paired": 2.0, "fastest": 2.0}
    assert r["tfmp_vs_keras_step_time"] == {"value": 1.0, "paired": 1.0, "fastest": 1.0}
    models = {"mlp": {"ratios": dict(r)}, "cnn": {"ratios": dict(r)}}
    # A matmul ceiling of 2.5x (paired), 2.0x (fastest): tfmp's 2.0x is 80% and 100% of it.
    report.add_ceiling_fractions(models, {"value": 4.0, "paired": 2.5, "fastest": 2.0})
    assert models["mlp"]["ratios"]["tfmp_vs_float32_of_ceiling"] == {
        "value": 0.5, "paired": 0.8, "fastest": 1.0}
    judged = {(t["model"], t["limit"]): t["met"] for t in report.verdicts(models, True)
              if t["ratio"] != "tfmp_vs_float32_of_roofline"}
    assert judged == {("mlp", 1.02): True, ("cnn", 1.02): True, ("cnn", 0.769): False,
                      ("mlp", 1.5): True, ("cnn", 1.8): True, ("mlp", 1.0): True,
                      ("cnn", 1.0): True, ("mlp", 0.7): True, ("mlp", 1.01): None,
                      ("cnn", 1.01): None}
    # No roofline profile: its target is listed, unmeasured, never met or failed.
    unmeasured = [t for t in report.verdicts(models, True) if t["ratio"] == "tfmp_vs_float32_of_roofline"]
    assert [(t["model"], t["value"], t["met"]) for t in unmeasured] == [("mlp", None, None)]
    # 70% of the roofline on the MLP, Transformer and ViT; the decoder at 0.85 of plain Keras.
    both = {"ratios": {**r, "tfmp_vs_keras_step_time": {"value": 0.86, "paired": 0.86, "fastest": 0.8},
                       "tfmp_vs_float32_of_roofline": {"value": 0.69, "paired": 0.69, "fastest": 0.9}}}
    targets = report.verdicts({"vit": both, "decoder": both, "cnn": both}, True)
    assert {(t["model"], t["limit"], t["value"], t["met"]) for t in targets
            if t["limit"] in (0.7, 0.85)} == {("vit", 0.7, 0.69, False), ("decoder", 0.85, 0.86, False)}
    assert "| vit | 70% of the roofline | tfmp_vs_float32_of_roofline >= 0.7 | 0.690 | 0.900 | NOT met |" in \
        report.markdown({**quick["written"], "targets": targets})
    assert "| mlp | 70% of the roofline | tfmp_vs_float32_of_roofline >= 0.7 | n/a | n/a | n/a |" in \
        report.markdown({**quick["written"], "targets": unmeasured})
    # (model, limit) of 1.0 holds two targets: not slower than float32, at or ahead of Keras.
    at_one = [t["met"] for t in report.verdicts(models, True) if t["limit"] == 1.0]
    assert at_one == [True, True, True, True]
    not_bf16 = report.verdicts(models, False)
    # 1.5x, 1.8x, 70% of the ceiling and of the roofline (the MLP's): not applicable.
    assert [t["met"] for t in not_bf16 if t["limit"] in (1.5, 1.8, 0.7)] == [None] * 4
    explicit = {(t["model"], t["limit"]): t["met"] for t in report.verdicts(models, False, auto=False)}
    assert explicit[("mlp", 1.02)] is True
    assert [t["met"] for t in report.verdicts(models, False, auto=False) if t["limit"] == 1.0] == [None] * 4
    # Where "auto" keeps float32 on a CPU, tfmp must cost nothing: 1.0 <= 1.01.
    float32_cpu = report.verdicts(models, False, float32_cpu=True)
    assert [(t["model"], t["met"]) for t in float32_cpu if t["limit"] == 1.01] == [("mlp", True), ("cnn", True)]
    assert all(t["fastest"] in (1.0, 2.0) for t in float32_cpu if t["value"] is not None)


def test_verdicts_judge_the_paired_ratio():
    # Medians agree (ratio of medians 1.0) but tfmp is 1.5x slower within every repeat.
    configs = {
        "float32": report.summarize_config([100.0, 100.0, 100.0]),
        "keras_mixed": report.summarize_config([150.0, 300.0, 450.0]),
        "tfmp": report.summarize_config([100.0, 200.0, 300.0]),
    }
    r = report.ratios(configs)
    assert r["tfmp_vs_keras_step_time"]["paired"] == 1.5
    assert r["tfmp_vs_keras_step_time"]["fastest"] == 1.5  # 450 / 300
    models = {"mlp": {"ratios": r}}
    report.add_ceiling_fractions(models, {"value": 2.0, "paired": 2.0, "fastest": 2.0})
    overhead = [t for t in report.verdicts(models, True) if t["ratio"] == "tfmp_vs_keras_step_time"]
    assert [(t["limit"], t["value"], t["met"]) for t in overhead] == [
        (1.02, 1.5, False), (1.0, 1.5, False), (1.01, 1.5, None)]


def test_calibrated_steps_stay_in_bounds():
    assert harness.calibrate_steps(0.01, 3.0, 10, 2000) == 300
    assert harness.calibrate_steps(1.0, 3.0, 10, 2000) == 10
    assert harness.calibrate_steps(1e-6, 3.0, 10, 2000) == 2000


def test_memory_fields_come_from_estimate_memory():
    keras.config.set_dtype_policy("mixed_bfloat16")  # the conftest fixture restores it
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(4)(inputs))
    model.compile("sgd", "mse")
    counted = memory.model_memory(model, batch_size=2)
    # One (2, 4) bfloat16 output; kernel 8x4 + bias 4 as float32 master weights.
    assert counted["activation_bytes"] == 2 * 4 * 2
    assert counted["parameter_bytes"] == counted["gradient_bytes"] == (32 + 4) * 4
    assert set(counted) == set(memory.FIELDS)


def test_unknown_config_is_rejected_in_the_project_template():
    workload = next(iter(run.workloads(quick=True).values()))
    with pytest.raises(ValueError, match=r"Invalid `config` argument.*Received: config='fp16'"):
        harness.prepare(workload, "fp16", "mixed_bfloat16", "unused", warmup_steps=2)


def test_guard_cost_pairs_each_repeat_with_plain_keras():
    times = {"keras": [1.0, 2.0, 4.0], "guard=loss": [1.0, 2.2, 4.0], "guard=gradients": [1.5, 2.0, 8.0]}
    assert guard_cost.paired_ratios(times) == {"guard=loss": 1.0, "guard=gradients": 1.5}
    assert guard_cost.fastest_ratios(times) == {"guard=loss fastest": 1.0,
                                                "guard=gradients fastest": 1.5}
    before = keras.config.dtype_policy().name
    # One workload: the script's loop is the same for each (the MLP: the quickest to build).
    results = guard_cost.main(["--repeats", "1", "--steps", "2", "--size", "quick", "--workloads", "mlp",
                               "--policies", "float32"])
    assert set(results) == {"mlp float32 wall", "mlp float32 cpu"}
    guards = [f"guard={g}" for g in ("loss", "batch", "gradients", "values")]  # every guard by default
    for row in results.values():  # paired and fastest ratios to plain Keras, each configuration's median
        assert set(row) == {*guards, *(f"{g} fastest" for g in guards), *(f"{c} ms" for c in ["keras", *guards])}
    assert all(value > 0 for row in results.values() for value in row.values())
    assert keras.config.dtype_policy().name == before


def _run_under(policy, model, roofline_steps=None):
    """A quick run of `model` with ``--policy policy``: the results and the model's configs,
    checked to run plain Keras and tfmp under `policy`."""
    results = run.run_suite(quick=True, repeats=1, models=[model], policy=policy,
                            roofline_steps=roofline_steps)
    assert results["decision"]["run"] == policy
    configs = results["models"][model]["configs"]
    assert {c: configs[c]["policy"] for c in harness.CONFIGS} == {
        "float32": "float32", "keras_mixed": policy, "tfmp": policy}
    return results, configs


def test_explicit_policy_runs_keras_and_tfmp_under_it():
    results, cnn = _run_under("mixed_bfloat16", "cnn")
    assert cnn["tfmp"]["fused_batchnorm"] == [4, 4]
    assert cnn["keras_mixed"]["fused_batchnorm"] == [0, 4]
    # BatchNormalization keeps the 16-bit policy under tfmp: activations as plain Keras's
    # but for the float32 logits (batch x 10 classes, 2 more bytes each).
    extra = cnn["tfmp"]["memory"]["activation_bytes"] - cnn["keras_mixed"]["memory"]["activation_bytes"]
    assert extra == results["models"]["cnn"]["batch_size"] * 10 * 2
    assert cnn["float32"]["memory"]["activation_bytes"] > cnn["tfmp"]["memory"]["activation_bytes"]
    assert results["matmul"]["dtype"] == "bfloat16"
    verdicts = {(t["ratio"], t["limit"]): t["met"] for t in results["targets"]}
    assert verdicts[("tfmp_vs_float32", 1.0)] is None  # not "auto"
    assert verdicts[("tfmp_vs_float32", 1.8)] is None


def test_float32_policy_measures_what_tfmp_costs_where_auto_keeps_float32():
    results, _ = _run_under("float32", "mlp", roofline_steps=0)
    assert results["matmul"]["dtype"] == "float32"
    # No profile asked for: no roofline, "n/a" in its columns.
    assert results["models"]["mlp"]["roofline"] is None
    assert results["models"]["mlp"]["ratios"]["tfmp_vs_float32_of_roofline"] is None
    assert "| n/a | n/a |" in report.markdown(results) and "Roofline:" not in report.markdown(results)
    verdicts = {(t["what"], t["model"]): t for t in results["targets"]}
    costs_nothing = verdicts[("costs nothing where auto is float32", "mlp")]
    assert costs_nothing["met"] == (costs_nothing["value"] <= 1.01)  # judged, not "n/a"
    assert verdicts[("at or ahead of plain Keras on a bf16 CPU", "mlp")]["met"] is None
    assert verdicts[("auto not slower than float32", "mlp")]["met"] is None


def test_decoder_loss_table_pairs_each_repeat_with_kerass_and_names_the_memory_method():
    from benchmarks import decoder_loss

    def record(peak, ms, memory):
        return {"step_peak_mib": peak, "step_ms": ms, "loss_relative_difference": 0.0,
                "logits_dtype": "float32", "memory": memory}

    # per repeat fused/keras memory: 0.5, 0.1, 0.3 -> paired median 0.3 (the ratio of medians would be 0.25)
    repeats = [{"keras": record(100, 10, "allocator"), "fused": record(50, 5, "allocator")},
               {"keras": record(400, 10, "allocator"), "fused": record(40, 5, "allocator")},
               {"keras": record(200, 20, "rss"), "fused": record(60, 20, "allocator")}]
    results = {"cpu": "c", "cores": 2, "tensorflow": "t", "keras": "k", "model": "gpt2", "tokens": 8,
               "batch": 2, "seq": 4, "dim": 8, "chunk_bytes": None, "steps": 1, "repeats": 3,
               "onednn": "unset", "load_start": [0], "load_end": [0], "configs": ["keras", "fused"],
               "vocabs": {"32000": repeats}}
    table = decoder_loss.markdown(results)
    assert "step peak read by: allocator, rss" in table and "model gpt2" in table
    fused = next(line for line in table.splitlines() if line.startswith("| 32000 | fused"))
    cells = [c.strip() for c in fused.strip("|").split("|")]
    assert cells[3:7] == ["50", "0.30", "5", "0.50"]
