"""The side experiments of benchmarks/README.md, one subcommand each, variants alternated.

    python benchmarks/side_experiments.py xla                   # MLP: bf16 vs float32, XLA on and off
    python benchmarks/side_experiments.py onednn-rewrite        # CNN: oneDNN's bf16 graph rewrite
    python benchmarks/side_experiments.py cnn-without-bn        # CNN with and without BatchNormalization
    python benchmarks/side_experiments.py transformer-overhead  # tfmp vs plain Keras, its guard, its monitor, tfmp vs itself
    python benchmarks/side_experiments.py gelu                  # Transformer, ViT: tfmp's float32-inside GELU vs Keras's
    python benchmarks/side_experiments.py cross-entropy         # decoder: the loss from bfloat16 logits vs Keras's kernel
    python benchmarks/side_experiments.py bias-gradient         # Transformer, ViT: summed bias gradients vs Keras's BiasAddGrad
    python benchmarks/side_experiments.py bias-gradient-resnet50  # ResNet50: the same for Conv2D biases
    python benchmarks/side_experiments.py xla --repeats 15 --json xla.json
    python benchmarks/side_experiments.py xla --quick           # tiny sizes: checks that it runs

Method of the suite (``benchmarks/run.py``, whose workloads, configurations and
timing loop these reuse): the full-size workloads of `benchmarks.workloads`, each
variant built and warmed up once, then timed alternately in this one process, the
order rotated each repeat (``--repeats``, default 9), each timed call lasting
about 3 s for the slowest variant. Reported: median samples/s per variant and,
per ratio of samples/s, the median of the ratios within each repeat (paired:
cancels load drifting between repeats) beside the ratio of the medians. The
16-bit variants all use ``mixed_bfloat16`` (the experiments are about bf16 on a
CPU); on a CPU without AVX512_BF16 it is emulated, and the numbers say nothing
about a machine that has it.

``onednn-rewrite`` sets Grappler's ``auto_mixed_precision_onednn_bfloat16``, a
process-wide option, yet its variants alternate in this process like the others:
TensorFlow hands the current options to every call of a `tf.function` and
optimizes a function once per distinct set of them, so the option is set around
each call of a rewrite variant only (`benchmarks.harness.grappler_options`). The
run first checks that the rewrite changes a float32 matmul here
(``rewrite_applies``); where it does not, its variants equal the plain ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tfmp

import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402
from benchmarks import harness, report, run  # noqa: E402
from benchmarks.harness import Overrides  # noqa: E402
from benchmarks.workloads import Workload, workloads  # noqa: E402

BF16 = "mixed_bfloat16"
REWRITE = {"auto_mixed_precision_onednn_bfloat16": True}
_TIMING = ("warmup", "seconds", "min_steps", "max_steps")
FULL = dict({k: run.FULL[k] for k in _TIMING}, repeats=9)
QUICK = dict({k: run.QUICK[k] for k in _TIMING}, repeats=2)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One model to time: a workload under a configuration of `benchmarks.harness`.

    Attributes:
        workload: String. Name in `benchmarks.workloads.workloads`.
        config: String. One of `harness.CONFIGS` (``keras_mixed`` runs `BF16`).
        overrides: `harness.Overrides`. What differs from the configuration.
        batch_norm: Bool. False: the CNN without BatchNormalization.
    """

    workload: str
    config: str
    overrides: Overrides = dataclasses.field(default_factory=Overrides)
    batch_norm: bool = True


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Variants timed together and the ratios reported.

    Attributes:
        what: String. One line for the help and the report.
        variants: Dict label -> `Variant`, all of the same batch size.
        ratios: Tuple of ``(numerator, denominator)`` labels: ratios of samples/s.
        step_shares: Dict label -> ``(with, without)`` variant labels: the share
            of a ``with`` step that the difference takes, 1 - speed(with) /
            speed(without).
    """

    what: str
    variants: Dict[str, Variant]
    ratios: Tuple[Tuple[str, str], ...]
    step_shares: Dict[str, Tuple[str, str]] = dataclasses.field(default_factory=dict)


def _plain(workload: str, policy: str, batch_norm: bool = True, **overrides) -> Variant:
    """`workload` under plain Keras, ``float32`` or `BF16`, with `overrides`."""
    config = "float32" if policy == "float32" else "keras_mixed"
    return Variant(workload, config, Overrides(**overrides), batch_norm)


def _bias_gradient_variants(*names: str) -> Dict[str, Variant]:
    """tfmp on each workload with its bias gradients summed, and with Keras's ``BiasAddGrad``."""
    return {f"{name} {label}": Variant(name, "tfmp", Overrides(tfmp_policy=BF16, bias_gradient_summed=summed))
            for name in names for label, summed in (("summed", True), ("BiasAddGrad", False))}


EXPERIMENTS = {
    "xla": Experiment(
        "MLP, plain Keras: mixed_bfloat16 vs float32 with jit_compile=True and False",
        {"float32": _plain("mlp", "float32", jit_compile=False),
         BF16: _plain("mlp", BF16, jit_compile=False),
         "float32 + XLA": _plain("mlp", "float32", jit_compile=True),
         f"{BF16} + XLA": _plain("mlp", BF16, jit_compile=True)},
        ((f"{BF16} + XLA", "float32 + XLA"), (BF16, "float32"),
         ("float32 + XLA", "float32"), (f"{BF16} + XLA", BF16)),
    ),
    "onednn-rewrite": Experiment(
        "CNN, plain Keras: Grappler's auto_mixed_precision_onednn_bfloat16 on mixed_bfloat16 "
        "and on float32",
        {BF16: _plain("cnn", BF16), f"{BF16} + rewrite": _plain("cnn", BF16, grappler=REWRITE),
         "float32": _plain("cnn", "float32"),
         "float32 + rewrite": _plain("cnn", "float32", grappler=REWRITE)},
        ((f"{BF16} + rewrite", BF16), ("float32 + rewrite", "float32"),
         ("float32 + rewrite", BF16), (BF16, "float32")),
    ),
    "cnn-without-bn": Experiment(
        "CNN, plain Keras: mixed_bfloat16 vs float32 with and without BatchNormalization",
        {"float32": _plain("cnn", "float32"), BF16: _plain("cnn", BF16),
         "float32 without BN": _plain("cnn", "float32", batch_norm=False),
         f"{BF16} without BN": _plain("cnn", BF16, batch_norm=False)},
        ((f"{BF16} without BN", "float32 without BN"), (BF16, "float32")),
        {"BatchNormalization, float32 step": ("float32", "float32 without BN"),
         f"BatchNormalization, {BF16} step": (BF16, f"{BF16} without BN")},
    ),
    "transformer-overhead": Experiment(
        "Transformer, mixed_bfloat16: tfmp, and tfmp's guard or monitor alone, vs plain Keras; "
        "tfmp vs a second, identical tfmp (the host's noise floor)",
        {"Keras": Variant("transformer", "keras_mixed"),
         "tfmp": Variant("transformer", "tfmp", Overrides(tfmp_policy=BF16)),
         "Keras + guard": Variant("transformer", "keras_mixed", Overrides(guard=True)),
         "Keras + monitor": Variant("transformer", "keras_mixed", Overrides(monitor=True)),
         "tfmp again": Variant("transformer", "tfmp", Overrides(tfmp_policy=BF16))},
        (("tfmp", "Keras"), ("Keras + guard", "Keras"), ("Keras + monitor", "Keras"),
         ("tfmp again", "Keras"), ("tfmp", "tfmp again")),
    ),
    "gelu": Experiment(
        "Transformer and ViT, mixed_bfloat16: tfmp with its exact GELU in float32 inside vs "
        "tfmp with Keras's 16-bit GELU, vs plain Keras",
        {"Keras": Variant("transformer", "keras_mixed"),
         "tfmp": Variant("transformer", "tfmp", Overrides(tfmp_policy=BF16, gelu_float32_inside=True)),
         "tfmp, Keras's GELU": Variant("transformer", "tfmp",
                                       Overrides(tfmp_policy=BF16, gelu_float32_inside=False)),
         "ViT Keras": Variant("vit", "keras_mixed"),
         "ViT tfmp": Variant("vit", "tfmp", Overrides(tfmp_policy=BF16, gelu_float32_inside=True)),
         "ViT tfmp, Keras's GELU": Variant("vit", "tfmp", Overrides(tfmp_policy=BF16, gelu_float32_inside=False))},
        (("tfmp", "tfmp, Keras's GELU"), ("tfmp", "Keras"), ("tfmp, Keras's GELU", "Keras"),
         ("ViT tfmp", "ViT tfmp, Keras's GELU"), ("ViT tfmp", "ViT Keras"), ("ViT tfmp, Keras's GELU", "ViT Keras")),
    ),
    "cross-entropy": Experiment(
        "decoder, mixed_bfloat16: tfmp with its sparse cross-entropy read from the bfloat16 logits vs "
        "tfmp with Keras's cast and float32 kernel, vs plain Keras",
        {"Keras": Variant("decoder", "keras_mixed"),
         "tfmp": Variant("decoder", "tfmp", Overrides(tfmp_policy=BF16)),
         "tfmp, Keras's kernel": Variant("decoder", "tfmp", Overrides(tfmp_policy=BF16,
                                                                       speedups_off=("cross_entropy",)))},
        (("tfmp", "tfmp, Keras's kernel"), ("tfmp", "Keras"), ("tfmp, Keras's kernel", "Keras")),
    ),
    "bias-gradient": Experiment(
        "Transformer and ViT, mixed_bfloat16: tfmp with its Dense bias gradients summed with float32 "
        "accumulation vs tfmp with Keras's BiasAddGrad",
        _bias_gradient_variants("transformer", "vit"),
        (("transformer summed", "transformer BiasAddGrad"), ("vit summed", "vit BiasAddGrad")),
    ),
    "bias-gradient-resnet50": Experiment(
        "ResNet50, mixed_bfloat16: tfmp with its bias gradients summed with float32 accumulation "
        "(the Conv2D ones kept on oneDNN's fused kernel, as tfmp decides where it is exact, or "
        "summed too) vs tfmp with Keras's BiasAddGrad",
        {**_bias_gradient_variants("resnet50"),
         "resnet50 summed with Conv2D": Variant("resnet50", "tfmp", Overrides(
             tfmp_policy=BF16, bias_gradient_summed=True, bias_gradient_conv2d=True))},
        (("resnet50 summed", "resnet50 BiasAddGrad"), ("resnet50 summed with Conv2D", "resnet50 BiasAddGrad")),
    ),
}


def rewrite_applies() -> bool:
    """Whether oneDNN's bf16 rewrite changes a float32 ``tf.matmul`` here.

    Returns:
        Bool. True when the product of a 64x64 float32 matrix with itself, computed
        by one `tf.function` with `REWRITE` in force, differs from the same call
        without it by more than 1e-3 of its largest entry (bfloat16 keeps 8
        significant bits; float32 results of one kernel do not differ at all).
    """
    a = tf.random.stateless_normal((64, 64), seed=(1, 2))
    product = tf.function(lambda x: tf.matmul(x, x))
    exact = product(a)
    with harness.grappler_options(REWRITE):
        rewritten = product(a)
    gap = float(tf.reduce_max(tf.abs(rewritten - exact)))
    return gap > 1e-3 * float(tf.reduce_max(tf.abs(exact)))


def _facts(prepared: harness.ConfiguredRun) -> dict:
    """What the variant's model really ran with: its GELU, bias-gradient and cross-entropy decisions, optimizer class, XLA, monitor."""
    found = tfmp.attachment(prepared.model)
    return {
        **{field: getattr(found, field) if found is not None else "keras (not attached)"
           for field in ("gelu", "bias_gradient", "cross_entropy")},
        "optimizer": type(prepared.model.optimizer).__name__,
        "jit_compile": bool(prepared.model.jit_compile),
        "monitor": any(isinstance(c, tfmp.LossScaleMonitor) for c in prepared.callbacks),
    }


#: At quick size (tests), the quick workload standing in for one the quick suite lacks.
QUICK_STAND_INS = {"resnet50": "cnn"}


def _workload(chosen: Dict[str, Workload], name: str) -> Workload:
    """The workload `name` of `chosen`, or its `QUICK_STAND_INS` stand-in when `chosen` lacks it."""
    return chosen[name] if name in chosen else chosen[QUICK_STAND_INS[name]]


def run_experiment(name: str, quick: bool = False, repeats: Optional[int] = None) -> dict:
    """Builds, warms up and times the variants of one experiment, alternated.

    Args:
        name: String. A key of `EXPERIMENTS`.
        quick: Bool. Tiny sizes and 2 repeats: checks that it runs.
        repeats: Int >= 1 or None (9, or 2 with `quick`).

    Returns:
        Dict (the ``--json`` content): ``experiment``, ``what``, ``machine``
        (`run.machine` and ``load_average_end``), ``suite`` (sizes, duration),
        ``policy``, ``batch_size``, ``steps_per_repeat``, ``variants`` (per label:
        workload, configuration, overrides, `_facts`, policy, samples/s per
        repeat and their median, memory), ``ratios`` (per ``"A / B"``:
        ``numerator``, ``denominator``, ``value`` the ratio of medians,
        ``paired`` the median of the per-repeat ratios), ``step_shares`` (per
        label: ``with``, ``without``, ``value`` and ``paired`` as 1 - the
        ratio) and, for ``onednn-rewrite``, ``rewrite_applies``.
    """
    experiment = EXPERIMENTS[name]
    sizes = dict(QUICK if quick else FULL)
    if repeats is not None:
        sizes["repeats"] = repeats
    start = time.perf_counter()
    results = {"experiment": name, "what": experiment.what, "machine": run.machine(),
               "suite": {"quick": quick, **sizes}, "policy": BF16}
    if any(v.overrides.grappler for v in experiment.variants.values()):
        results["rewrite_applies"] = rewrite_applies()
    chosen = {bn: workloads(quick, batch_norm=bn) for bn in (True, False)}
    prepared: Dict[str, harness.ConfiguredRun] = {}
    described = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # bf16 emulated on some CPUs
        # "Keras + monitor" has a plain optimizer on purpose: the monitor's note about it.
        warnings.filterwarnings("ignore", "LossScaleMonitor: the optimizer", UserWarning)
        for index, (label, variant) in enumerate(experiment.variants.items()):
            workload = _workload(chosen[variant.batch_norm], variant.workload)
            print(f"  {name}: building and warming up {label}", file=sys.stderr, flush=True)
            prepared[label] = harness.prepare(
                workload, variant.config, BF16, os.path.join(tmp, str(index)), sizes["warmup"],
                variant.overrides)
            described[label] = {"workload": workload.description, "config": variant.config,
                                "overrides": dataclasses.asdict(variant.overrides),
                                **_facts(prepared[label])}
        batch_sizes = {_workload(chosen[v.batch_norm], v.workload).batch_size
                       for v in experiment.variants.values()}
        (batch_size,) = batch_sizes  # one per experiment, by construction of EXPERIMENTS
        timed = run.bench_runs(prepared, batch_size, sizes, name)
    configs = timed.pop("configs")
    results.update(timed)
    results["variants"] = {label: {**described[label], **configs[label]} for label in configs}
    results["ratios"] = {
        f"{a} / {b}": {"numerator": a, "denominator": b, **report.speed_ratio(configs, a, b)}
        for a, b in experiment.ratios
    }
    results["step_shares"] = {}
    for label, (with_, without) in experiment.step_shares.items():
        ratio = report.speed_ratio(configs, with_, without)
        results["step_shares"][label] = {"with": with_, "without": without,
                                         **{k: 1.0 - v for k, v in ratio.items()}}
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["suite"]["duration_s"] = time.perf_counter() - start
    return results


def markdown(results: dict) -> str:
    """The machine line and Markdown tables of one experiment's results.

    Args:
        results: Dict as returned by `run_experiment`.

    Returns:
        String of Markdown.
    """
    m, suite = results["machine"], results["suite"]
    lines = [report.machine_line(m, suite["duration_s"]),
             f"CPU bf16 flags: {', '.join(m['cpu_bf16_flags']) or 'none (bf16 emulated)'}", "",
             (f"{results['what']}; batch {results['batch_size']}, {suite['repeats']} repeats "
              f"of {results['steps_per_repeat']} timed steps, variants alternated."), ""]
    if "rewrite_applies" in results:
        lines += [f"The rewrite changes a float32 matmul here: {results['rewrite_applies']}.", ""]
    rows = [[label, v["policy"], f"{v['median_samples_per_s']:,.1f}",
             ", ".join(f"{s:,.1f}" for s in v["samples_per_s"])]
            for label, v in results["variants"].items()]
    lines += report.table(["variant", "policy", "samples/s (median)", "per repeat"], rows)
    lines.append("")
    rows = [[label, f"{r['paired']:.3f}x", f"{r['value']:.3f}x"]
            for label, r in results["ratios"].items()]
    lines += report.table(["speed ratio", "median of per-repeat ratios", "ratio of medians"], rows)
    if results["step_shares"]:
        rows = [[label, f"{100 * s['paired']:.1f}%", f"{100 * s['value']:.1f}%"]
                for label, s in results["step_shares"].items()]
        lines += [""] + report.table(["share of a step", "paired", "of medians"], rows)
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Command line: one subcommand per experiment; prints its Markdown.

    Args:
        argv: Sequence of strings or None (``sys.argv[1:]``).

    Returns:
        Dict of results (`run_experiment`; what ``--json`` writes).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name, experiment in EXPERIMENTS.items():
        sub = subparsers.add_parser(name, help=experiment.what, description=experiment.what)
        run.add_common_arguments(sub, "timed repeats (default 9; 2 with --quick)")
    args = run.parse_checked(parser, argv)
    results = run_experiment(args.experiment, args.quick, args.repeats)
    return run.publish(results, markdown(results), args.json)


if __name__ == "__main__":
    main()
