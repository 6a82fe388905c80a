"""From raw timings to medians, ratios, target verdicts and Markdown tables.

Ratios of one model (samples/s of the numerator over the denominator):

* ``keras_mixed_vs_float32``: plain Keras mixed / float32 (speed-up).
* ``tfmp_vs_float32``: tfmp / float32 (speed-up of ``enable("auto")``).
* ``tfmp_vs_keras_step_time``: step time of tfmp / plain Keras mixed (overhead;
  1.0 means none), i.e. samples/s of plain Keras / samples/s of tfmp.
* ``tfmp_vs_float32_of_ceiling`` (`add_ceiling_fractions`): ``tfmp_vs_float32``
  divided by the matmul ceiling (``tf.matmul`` 16-bit / float32 GFLOP/s on the
  same machine): the share of the hardware's 16-bit speed-up that tfmp reaches.
* ``tfmp_vs_float32_of_roofline`` (`benchmarks.roofline.add_roofline_fractions`):
  ``tfmp_vs_float32`` divided by the model's roofline speed-up (its own float32
  profile, matmuls at the matmul ceiling, memory-bound ops at half their time),
  or None when the model was not profiled (shown as "n/a").

Each ratio has three forms: ``value``, the ratio of the medians over the repeats;
``paired``, the median over repeats of the ratio within one repeat
(configurations alternate inside a repeat, so it cancels load drifting between
repeats); ``fastest``, the ratio of the fastest repeats (the best samples/s of
each side), which a host whose timing is bimodal (a whole ``fit`` call at its
usual speed or much slower, at random) leaves readable where medians are not.

Targets (`TARGETS`), judged on the paired form, each where it applies:

* everywhere: tfmp overhead (``tfmp_vs_keras_step_time``) <= 1.02 on every
  model (issue 9); on the CNN, whose BatchNormalization tfmp runs on the fused
  kernel, tfmp at least 1.3x faster than plain Keras mixed (step-time ratio
  <= 1 / 1.3, issues 15 and 27);
* where "auto" picks mixed_bfloat16 on a CPU (``bf16_cpu``): ``tfmp_vs_float32``
  >= 1.5 on the MLP, >= 1.8 on the CNN, >= 1.3 on ResNet50 (issue 9); tfmp at or
  ahead of plain Keras (step-time ratio <= 1.00) on every model, and
  ``tfmp_vs_float32_of_ceiling`` >= 0.70 on the MLP, the Transformer and
  ResNet50 (issue 27); ``tfmp_vs_float32_of_roofline`` >= 0.70 on the MLP, the
  Transformer and the ViT, and the decoder at 0.85 of plain Keras's step time
  or less (issue 54; a model run without its roofline profile is "n/a");
* where tfmp ran "auto" (``auto``): ``tfmp_vs_float32`` >= 1.0 on every model
  ("auto" never picks a policy slower than float32);
* where tfmp runs float32 on a CPU (``float32_cpu``: "auto" kept it, or
  ``run.py --policy float32``): tfmp costs nothing, step-time ratio <= 1.01
  (issue 27).
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

#: Applicability of a target: everywhere, on a CPU where "auto" picks
#: mixed_bfloat16, wherever tfmp ran "auto", on a CPU where "auto" keeps float32.
WHERE = ("any", "bf16_cpu", "auto", "float32_cpu")
# (model, ratio, comparison, limit, what it checks, where it applies)
TARGETS = (
    (None, "tfmp_vs_keras_step_time", "<=", 1.02, "tfmp overhead vs plain Keras", "any"),
    ("cnn", "tfmp_vs_keras_step_time", "<=", round(1 / 1.3, 3), "fused BN: 1.3x plain Keras", "any"),
    ("mlp", "tfmp_vs_float32", ">=", 1.5, "auto speed-up on a bf16 CPU", "bf16_cpu"),
    ("cnn", "tfmp_vs_float32", ">=", 1.8, "auto speed-up on a bf16 CPU", "bf16_cpu"),
    ("resnet50", "tfmp_vs_float32", ">=", 1.3, "auto speed-up on a bf16 CPU", "bf16_cpu"),
    (None, "tfmp_vs_float32", ">=", 1.0, "auto not slower than float32", "auto"),
    (None, "tfmp_vs_keras_step_time", "<=", 1.0, "at or ahead of plain Keras on a bf16 CPU", "bf16_cpu"),
    ("mlp", "tfmp_vs_float32_of_ceiling", ">=", 0.7, "70% of the matmul ceiling", "bf16_cpu"),
    ("transformer", "tfmp_vs_float32_of_ceiling", ">=", 0.7, "70% of the matmul ceiling", "bf16_cpu"),
    ("resnet50", "tfmp_vs_float32_of_ceiling", ">=", 0.7, "70% of the matmul ceiling", "bf16_cpu"),
    ("mlp", "tfmp_vs_float32_of_roofline", ">=", 0.7, "70% of the roofline", "bf16_cpu"),
    ("transformer", "tfmp_vs_float32_of_roofline", ">=", 0.7, "70% of the roofline", "bf16_cpu"),
    ("vit", "tfmp_vs_float32_of_roofline", ">=", 0.7, "70% of the roofline", "bf16_cpu"),
    ("decoder", "tfmp_vs_keras_step_time", "<=", 0.85, "decoder: 0.85 of plain Keras", "bf16_cpu"),
    (None, "tfmp_vs_keras_step_time", "<=", 1.01, "costs nothing where auto is float32", "float32_cpu"),
)
#: The ratio forms kept per ratio (module docstring).
FORMS = ("value", "paired", "fastest")
MIB = 2.0**20
#: CPU flags the report names when present: bfloat16 (AVX512_BF16, AMX) and
#: float16 (AVX512_FP16, F16C conversions) arithmetic, and AVX2.
CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx2", "f16c")


def summarize_config(samples_per_s: List[float]) -> dict:
    """Median and spread of one configuration's repeats.

    Args:
        samples_per_s: List of floats > 0, one per repeat.

    Returns:
        Dict: ``samples_per_s`` (the list), ``median_samples_per_s``,
        ``min_samples_per_s``, ``max_samples_per_s``.
    """
    return {
        "samples_per_s": list(samples_per_s),
        "median_samples_per_s": statistics.median(samples_per_s),
        "min_samples_per_s": min(samples_per_s),
        "max_samples_per_s": max(samples_per_s),
    }


def speed_ratio(configs: Dict[str, dict], numerator: str, denominator: str) -> dict:
    """The three forms (`FORMS`) of a ratio of samples/s between two configurations.

    Returns:
        Dict: ``value`` (ratio of the medians), ``paired`` (median of the
        per-repeat ratios), ``fastest`` (ratio of the fastest repeats).
    """
    return ratio_forms(configs[numerator]["samples_per_s"], configs[denominator]["samples_per_s"])


def ratio_forms(numerator: List[float], denominator: List[float]) -> dict:
    """`FORMS` of numerator / denominator from per-repeat rates (higher is faster).

    Args:
        numerator: List of floats > 0, one per repeat.
        denominator: List of floats > 0, one per repeat (same length).

    Returns:
        Dict ``{"value", "paired", "fastest"}`` of floats.
    """
    paired = [a / b for a, b in zip(numerator, denominator)]
    return {
        "value": statistics.median(numerator) / statistics.median(denominator),
        "paired": statistics.median(paired),
        "fastest": max(numerator) / max(denominator),
    }


def add_ceiling_fractions(models: Dict[str, dict], matmul_ratio: dict) -> None:
    """Adds ``tfmp_vs_float32_of_ceiling`` to each model's ``ratios``, form by form.

    Args:
        models: Dict model name -> dict with ``ratios`` (as from `ratios`); changed in place.
        matmul_ratio: Dict of `FORMS`: the matmul ceiling, 16-bit / float32 GFLOP/s.
    """
    for model in models.values():
        speed_up = model["ratios"]["tfmp_vs_float32"]
        model["ratios"]["tfmp_vs_float32_of_ceiling"] = {
            form: speed_up[form] / matmul_ratio[form] for form in FORMS}


def ratios(configs: Dict[str, dict]) -> Dict[str, dict]:
    """The three ratios of one model, from medians and paired per repeat.

    Args:
        configs: Dict config name -> dict with ``samples_per_s`` (list, one per
            repeat, same length for every config) and ``median_samples_per_s``.

    Returns:
        Dict ratio name -> ``{"value": float, "paired": float}``.
    """

    def speed(numerator: str, denominator: str) -> dict:
        return speed_ratio(configs, numerator, denominator)

    return {
        "keras_mixed_vs_float32": speed("keras_mixed", "float32"),
        "tfmp_vs_float32": speed("tfmp", "float32"),
        "tfmp_vs_keras_step_time": speed("keras_mixed", "tfmp"),
    }


def verdicts(
    models: Dict[str, dict], bf16_cpu: bool, auto: bool = True, float32_cpu: bool = False,
) -> List[dict]:
    """Checks each target of `TARGETS` against the measured paired ratios.

    Args:
        models: Dict model name -> dict with ``ratios`` as from `ratios` (and
            `add_ceiling_fractions`).
        bf16_cpu: Bool. tfmp ran "auto" and it picked mixed_bfloat16 on a CPU.
        auto: Bool. tfmp ran ``enable("auto")`` (False when ``--policy`` chose
            the policy: then "not slower than float32" does not apply).
        float32_cpu: Bool. tfmp ran float32 on a CPU ("auto" kept it, or it was asked for).

    Returns:
        List of dicts: ``model``, ``ratio``, ``op``, ``limit``, ``what``,
        ``where``, ``value`` (float, the median of the per-repeat ratios;
        None where the model has no such ratio, e.g. no roofline profile),
        ``fastest`` (float or None, the ratio of the fastest repeats), ``met``
        (bool, or None when the target does not apply here or was not measured).
    """
    applies = {"any": True, "bf16_cpu": bf16_cpu, "auto": auto, "float32_cpu": float32_cpu}
    out = []
    for model_filter, ratio, op, limit, what, where in TARGETS:
        for name, model in models.items():
            if model_filter not in (None, name):
                continue
            measured = model["ratios"].get(ratio)  # None: not measured (no roofline profile)
            value = None if measured is None else measured["paired"]
            met: Optional[bool] = None
            if value is not None and applies[where]:
                met = value <= limit if op == "<=" else value >= limit
            out.append(dict(model=name, ratio=ratio, op=op, limit=limit, what=what, where=where,
                            value=value, fastest=None if measured is None else measured["fastest"],
                            met=met))
    return out


def machine_line(machine: dict, duration_s: float) -> str:
    """Where and when a run was made, in one line.

    Args:
        machine: Dict as from ``benchmarks/run.py``'s `machine`, with
            ``load_average_end`` added at the end of the run.
        duration_s: Float. Seconds the run took.

    Returns:
        String: CPU, cores, the ISA oneDNN ran TensorFlow's matmuls with (when
        recorded), TensorFlow and Keras versions, date, load average (1 minute)
        at start and end, duration.
    """
    m = machine
    flags = ", ".join(m.get("cpu_flags", [])) or "none of " + ", ".join(CPU_FLAGS)
    isa = m.get("onednn_isa")
    isa_text = f"; oneDNN matmul ISA: {isa['label']}" if isa else ""
    return (f"{m['cpu']} (flags: {flags}{isa_text}), {m['cores']} cores; TensorFlow {m['tensorflow']}, Keras "
            f"{m['keras']}; {m['date']}; load average {m['load_average_start'][0]:.2f} "
            f"-> {m['load_average_end'][0]:.2f}; {duration_s:.0f} s")


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header, rows) -> List[str]:
    """Lines of a Markdown table: `header` (list of cells) and `rows` (lists of cells)."""
    return [_row(header), _row(["---"] * len(header))] + [_row(r) for r in rows]


def markdown(results: dict) -> str:
    """Markdown tables of a suite's results (speed, ratios, memory, targets).

    Args:
        results: Dict as written by ``benchmarks/run.py --json``.

    Returns:
        String of Markdown.
    """
    lines = []
    mm = results["matmul"]
    lines.append(
        f"tf.matmul {mm['size']}^3: {mm['dtype']} {mm['ratio']['value']:.2f}x float32 "
        f"(paired {mm['ratio']['paired']:.2f}x, fastest {mm['ratio']['fastest']:.2f}x; "
        f"{mm['configs']['float32']['median_gflops']:.0f} GFLOP/s float32 vs "
        f"{mm['configs'][mm['dtype']]['median_gflops']:.0f} {mm['dtype']}): the hardware ceiling."
    )
    if mm["dtype"] != "float32" and mm["ratio"]["paired"] < 1:
        lines.append(f"{mm['dtype']} matmuls are slower than float32 here: the rooflines take "
                     "matmuls at float32 speed (a mixed policy can keep them in float32).")
    if not results["models"]:  # --batchnorm-only
        return "\n".join(lines + _batchnorm_markdown(results.get("batchnorm")))
    lines += ["", "Ratios: median of the paired per-repeat ratios / ratio of the fastest repeats.", ""]
    rows = []
    for name, model in results["models"].items():
        c, r = model["configs"], model["ratios"]
        rows.append([
            name,
            *(f"{c[k]['median_samples_per_s']:,.0f}" for k in ("float32", "keras_mixed", "tfmp")),
            *(f"{r[k]['paired']:.2f}x / {r[k]['fastest']:.2f}x"
              for k in ("keras_mixed_vs_float32", "tfmp_vs_float32")),
            "{paired:.0%} / {fastest:.0%}".format(**r["tfmp_vs_float32_of_ceiling"]),
            *_roofline_cells(model),
            f"{r['tfmp_vs_keras_step_time']['paired']:.3f} / {r['tfmp_vs_keras_step_time']['fastest']:.3f}",
        ])
    lines += table(
        ["model", "float32 samples/s", "Keras mixed samples/s", "tfmp samples/s",
         "Keras mixed / float32", "tfmp / float32", "tfmp / float32 of ceiling",
         "roofline", "tfmp / float32 of roofline", "tfmp / Keras step time"],
        rows,
    )
    lines += _roofline_lines(results["models"])
    lines.append("")
    rows = []
    for name, model in results["models"].items():
        for config, c in model["configs"].items():
            m = c["memory"]
            peak = m["peak_device_bytes"]
            rows.append([
                name, config, c["policy"],
                f"{m['parameter_bytes'] / MIB:.2f}", f"{m['gradient_bytes'] / MIB:.2f}",
                f"{m['optimizer_bytes'] / MIB:.2f}",
                f"{m['activation_bytes'] / MIB:.2f}",
                "n/a on CPU" if peak is None else f"{peak / MIB:.1f}",
            ])
    lines += table(
        ["model", "config", "policy", "parameters MiB", "gradients MiB", "optimizer MiB",
         "activations MiB", "peak device MiB"],
        rows,
    )
    lines.append("")
    rows = []
    for t in results["targets"]:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        rows.append([t["model"], t["what"], f"{t['ratio']} {t['op']} {t['limit']}",
                     *("n/a" if t[form] is None else f"{t[form]:.3f}" for form in ("value", "fastest")),
                     verdict])
    lines += table(["model", "target", "rule", "paired", "fastest", "verdict"], rows)
    lines += _batchnorm_markdown(results.get("batchnorm"))
    return "\n".join(lines)


def _roofline_cells(model: dict) -> List[str]:
    """The roofline speed-up (paired form) and tfmp / float32 as a fraction of it, or "n/a"."""
    fraction = model["ratios"].get("tfmp_vs_float32_of_roofline")
    if fraction is None:
        return ["n/a", "n/a"]
    return [f"{model['roofline']['speed_up']['paired']:.2f}x",
            "{paired:.0%} / {fastest:.0%}".format(**fraction)]


def _roofline_lines(models: Dict[str, dict]) -> List[str]:
    """One line per profiled model: the parts of its float32 step the roofline scales."""
    profiled = {name: m["roofline"] for name, m in models.items() if m.get("roofline")}
    if not profiled:
        return []
    steps = sorted({r["steps"] for r in profiled.values()})
    lines = ["", f"Roofline: step / (matmul / max(ratio, 1) + halved / 2 + kept), from each model's "
             f"float32 profile ({' or '.join(map(str, steps))} traced steps; shares of the step):", ""]
    for name, r in profiled.items():
        s = r["split"]
        lines.append(f"- {name}: matmul/conv {s['matmul']:.0%}, halved (elementwise, normalization, "
                     f"softmax, casts) {s['halved']:.0%}, kept (optimizer, host) {s['kept']:.0%}")
    return lines


def _batchnorm_markdown(batchnorm: Optional[dict]) -> List[str]:
    """The "Keras BatchNormalization vs fused" table (empty without that section)."""
    if not batchnorm:
        return []
    rows = []
    for name, model in batchnorm["models"].items():
        c, r = model["configs"], model["ratios"]["fused_vs_keras"]
        fused = c["fused_bn"]["fused_batchnorm"]
        rows.append([name, batchnorm["policy"], f"{c['keras_mixed']['median_samples_per_s']:,.0f}",
                     f"{c['fused_bn']['median_samples_per_s']:,.0f}",
                     f"{r['value']:.2f}x ({r['paired']:.2f}x)", f"{fused[0]} of {fused[1]}"])
    return ["", f"Keras BatchNormalization vs fused ({batchnorm['policy']}, plain Keras compile):", ""] + table(
        ["model", "policy", "Keras BN samples/s", "fused BN samples/s", "fused / Keras",
         "BN layers fused"], rows)
