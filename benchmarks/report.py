"""From raw timings to medians, ratios, target verdicts and Markdown tables.

Ratios (all from medians over the repeats):

* ``keras_mixed_vs_float32``: samples/s of plain Keras mixed / float32 (speed-up).
* ``tfmp_vs_float32``: samples/s of tfmp / float32 (speed-up of ``enable("auto")``).
* ``tfmp_vs_keras_step_time``: step time of tfmp / plain Keras mixed (overhead;
  1.0 means none), i.e. samples/s of plain Keras / samples/s of tfmp.

Each ratio also has a ``paired`` form: the median over repeats of the ratio
within one repeat. Configurations alternate inside a repeat, so the paired form
cancels load that drifts between repeats; when the two disagree, the machine was
busy.

Targets (issues 9 and 15), judged on the paired form: tfmp overhead
(``tfmp_vs_keras_step_time``) <= 1.02 on every model; on the CNN, whose
BatchNormalization tfmp runs on the fused kernel, tfmp at least 1.3x faster than
plain Keras mixed (step-time ratio <= 1 / 1.3); where "auto" picks mixed_bfloat16
on a CPU (the reference machine's case; "n/a" elsewhere) ``tfmp_vs_float32`` >= 1.5
on the MLP, >= 1.8 on the CNN and >= 1.3 on ResNet50; ``tfmp_vs_float32`` >= 1.0
on every model when tfmp runs "auto" ("auto" never picks a policy slower than
float32; "n/a" when ``--policy`` chose the policy).
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

# (model, ratio, comparison, limit, what it checks)
TARGETS = (
    (None, "tfmp_vs_keras_step_time", "<=", 1.02, "tfmp overhead vs plain Keras"),
    ("cnn", "tfmp_vs_keras_step_time", "<=", round(1 / 1.3, 3), "fused BN: 1.3x plain Keras"),
    ("mlp", "tfmp_vs_float32", ">=", 1.5, "auto speed-up on a bf16 CPU"),
    ("cnn", "tfmp_vs_float32", ">=", 1.8, "auto speed-up on a bf16 CPU"),
    ("resnet50", "tfmp_vs_float32", ">=", 1.3, "auto speed-up on a bf16 CPU"),
    (None, "tfmp_vs_float32", ">=", 1.0, "auto not slower than float32"),
)
_BF16_CPU_ONLY = "auto speed-up on a bf16 CPU"
_AUTO_ONLY = "auto not slower than float32"
MIB = 2.0**20


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
    """``{"value": ratio of the medians, "paired": median of the per-repeat ratios}`` of samples/s."""
    num, den = configs[numerator], configs[denominator]
    paired = [a / b for a, b in zip(num["samples_per_s"], den["samples_per_s"])]
    return {
        "value": num["median_samples_per_s"] / den["median_samples_per_s"],
        "paired": statistics.median(paired),
    }


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


def verdicts(models: Dict[str, dict], bf16_cpu: bool, auto: bool = True) -> List[dict]:
    """Checks each target of `TARGETS` against the measured paired ratios.

    Args:
        models: Dict model name -> dict with ``ratios`` as from `ratios`.
        bf16_cpu: Bool. tfmp ran "auto" and it picked mixed_bfloat16 on a CPU,
            where the speed-up targets apply.
        auto: Bool. tfmp ran ``enable("auto")`` (False when ``--policy`` chose
            the policy: then "not slower than float32" does not apply).

    Returns:
        List of dicts: ``model``, ``ratio``, ``op``, ``limit``, ``what``,
        ``value`` (float, the median of the per-repeat ratios), ``met`` (bool,
        or None when the target does not apply).
    """
    out = []
    for model_filter, ratio, op, limit, what in TARGETS:
        for name, model in models.items():
            if model_filter not in (None, name):
                continue
            value = model["ratios"][ratio]["paired"]
            met: Optional[bool] = value <= limit if op == "<=" else value >= limit
            if (what == _BF16_CPU_ONLY and not bf16_cpu) or (what == _AUTO_ONLY and not auto):
                met = None
            out.append(dict(model=name, ratio=ratio, op=op, limit=limit, what=what,
                            value=value, met=met))
    return out


def machine_line(machine: dict, duration_s: float) -> str:
    """Where and when a run was made, in one line.

    Args:
        machine: Dict as from ``benchmarks/run.py``'s `machine`, with
            ``load_average_end`` added at the end of the run.
        duration_s: Float. Seconds the run took.

    Returns:
        String: CPU, cores, TensorFlow and Keras versions, date, load average
        (1 minute) at start and end, duration.
    """
    m = machine
    return (f"{m['cpu']}, {m['cores']} cores; TensorFlow {m['tensorflow']}, Keras "
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
        f"(paired {mm['ratio']['paired']:.2f}x; "
        f"{mm['configs']['float32']['median_gflops']:.0f} vs "
        f"{mm['configs'][mm['dtype']]['median_gflops']:.0f} GFLOP/s): the hardware ceiling."
    )
    if not results["models"]:  # --batchnorm-only
        return "\n".join(lines + _batchnorm_markdown(results.get("batchnorm")))
    lines.append("")
    rows = []
    for name, model in results["models"].items():
        c, r = model["configs"], model["ratios"]
        rows.append([
            name,
            *(f"{c[k]['median_samples_per_s']:,.0f}" for k in ("float32", "keras_mixed", "tfmp")),
            *(f"{r[k]['value']:.2f}x ({r[k]['paired']:.2f}x)"
              for k in ("keras_mixed_vs_float32", "tfmp_vs_float32", "tfmp_vs_keras_step_time")),
        ])
    lines += table(
        ["model", "float32 samples/s", "Keras mixed samples/s", "tfmp samples/s",
         "Keras mixed / float32", "tfmp / float32", "tfmp / Keras step time"],
        rows,
    )
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
                     f"{t['value']:.3f}", verdict])
    lines += table(["model", "target", "rule", "measured", "verdict"], rows)
    lines += _batchnorm_markdown(results.get("batchnorm"))
    return "\n".join(lines)


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
