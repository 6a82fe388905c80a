"""float16 training steps on this CPU beside float32: plain Keras, tfmp's fit, tfmp's custom loop.

tfmp never picks float16 on a CPU, but a user may ask for ``mixed_float16`` there
(to reproduce a float16 GPU's numerics, say). This measures what each path costs
against float32, for a matmul model, a convolution model and the depthwise and
separable convolutions of MobileNet- and EfficientNet-style models:

- ``MLP``: Dense 256 -> 512 -> 512 -> 10 (ReLU), batch 128;
- ``CNN``: two Conv2D 3x3 (16 -> 64 -> 64 channels, ReLU) on 32x32 inputs, max
  pooling, Dense 10, batch 32 (the convolution model of the float16 trap measured
  on Sapphire Rapids);
- ``DepthwiseConv2D``: two DepthwiseConv2D 3x3 (ReLU) on 32x32x64, max pooling,
  Dense 10, batch 32; ``SeparableConv2D``: two SeparableConv2D 3x3 (16 -> 64 -> 64,
  ReLU) on 32x32, the same head; ``DepthwiseConv1D`` and ``SeparableConv1D``: the
  same over 256 steps of 64 channels (kernel 3).

Per model, one training step (SGD) of each variant, each traced and warmed up, then
the variants alternated over the repeats (the order rotated each repeat). The MLP
and CNN (`VARIANTS`):

- ``float32``: plain Keras, float32;
- ``Keras float16``: plain Keras ``mixed_float16`` (Keras's LossScaleOptimizer);
- ``tfmp fit``: ``mixed_float16`` under tfmp, ``train_on_batch`` (the train
  function tfmp scopes);
- ``tfmp loop``: the same model with a custom step (`tfmp.scaled_gradients`,
  ``optimizer.apply``) called inside `tfmp.step_scope`;
- ``tfmp fit, remapper off``: as ``tfmp fit`` with the facts of this CPU plus
  AVX512_FP16 (the branch a Sapphire Rapids takes: Grappler's remapper off for the
  model), to show what that branch costs on this CPU.

The depthwise and separable models (`CONV_VARIANTS`): ``float32``, ``Keras
float16`` and tfmp's ``fit`` with the model's ``Attachment.conv`` and
``depthwise_conv`` set both to Keras's kernels (``tfmp, Keras's kernels``) and both
to float32 inside (``tfmp, float32 inside``), whatever this CPU's facts decide (the
decision here is printed: `tfmp/_src/float32/conv.py`).

Each variant's first step after its warm-up is timed alone: one over `STEP_BUDGET`
times float32's step is not timed further, and reported as ``> STEP_BUDGET x``
slower than float32 (plain Keras's float16 steps on a CPU whose oneDNN takes float16
run far over it), so the run takes minutes on any CPU.

Reported: median and fastest ms per step, and each variant's speed against float32
(median of the per-repeat ratios, and of the fastest repeats). The CPU flags are in
the machine line; on a CPU whose oneDNN takes float16 (AVX512_FP16) the Keras
float16 rows are where the traps show. First, the fused float16 matmul itself: a
float16 Dense training step with Grappler's remapper on and off
(`float16_fusion.measure`), which tells whether this CPU has the trap that tfmp
reads from its flags.

    python benchmarks/float16_cpu.py
    python benchmarks/float16_cpu.py --json float16_cpu.json
    python benchmarks/float16_cpu.py --quick      # tiny sizes: checks it runs
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tfmp

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402
from benchmarks import harness, report, run  # noqa: E402
from tfmp._src.float32 import conv  # noqa: E402
from tfmp._src.policy import float16_fusion  # noqa: E402
from tfmp._src.policy.hardware import detect_device_facts, injected_facts  # noqa: E402

VARIANTS = ("float32", "Keras float16", "tfmp fit", "tfmp loop", "tfmp fit, remapper off")
#: The variants of the depthwise and separable models (`CONV_LAYERS`).
CONV_VARIANTS = ("float32", "Keras float16", "tfmp, Keras's kernels", "tfmp, float32 inside")
#: Model sizes: (batch, input shape, widths) per model, full and quick.
SIZES = {"MLP": (128, (256,), (512, 512)), "CNN": (32, (32, 32, 16), (64, 64)),
         "DepthwiseConv2D": (32, (32, 32, 64), (64, 64)), "SeparableConv2D": (32, (32, 32, 16), (64, 64)),
         "DepthwiseConv1D": (32, (256, 64), (64, 64)), "SeparableConv1D": (32, (256, 64), (64, 64))}
#: Quick: one depthwise (2-D) and one separable (1-D) model beside the MLP and CNN.
QUICK_SIZES = {"MLP": (8, (16,), (16, 16)), "CNN": (4, (8, 8, 4), (8, 8)),
               "DepthwiseConv2D": (2, (8, 8, 4), (4,)), "SeparableConv1D": (2, (16, 4), (8,))}
#: The layer of each convolution model, given its width (a depthwise layer keeps its channels).
CONV_LAYERS = {
    "CNN": lambda width: keras.layers.Conv2D(width, 3, padding="same", activation="relu"),
    "DepthwiseConv2D": lambda width: keras.layers.DepthwiseConv2D(3, padding="same", activation="relu"),
    "SeparableConv2D": lambda width: keras.layers.SeparableConv2D(width, 3, padding="same", activation="relu"),
    "DepthwiseConv1D": lambda width: keras.layers.DepthwiseConv1D(3, padding="same", activation="relu"),
    "SeparableConv1D": lambda width: keras.layers.SeparableConv1D(width, 3, padding="same", activation="relu"),
}
#: A variant whose first timed step takes over this many float32 steps is not timed further.
STEP_BUDGET = 20.0


def build(kind: str, shape: tuple, widths: tuple) -> keras.Model:
    """The `kind` model under the current global policy, seeded."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    x = inputs
    if kind in CONV_LAYERS:
        for width in widths:
            x = CONV_LAYERS[kind](width)(x)
        pooling = keras.layers.MaxPooling2D if len(shape) == 3 else keras.layers.MaxPooling1D
        x = keras.layers.Flatten()(pooling(4)(x))
    else:
        for width in widths:
            x = keras.layers.Dense(width, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))


def variants_of(kind: str) -> Tuple[str, ...]:
    """`VARIANTS` for the MLP and CNN, `CONV_VARIANTS` for the depthwise and separable models."""
    return VARIANTS if kind in ("MLP", "CNN") else CONV_VARIANTS


def _set_convolutions(attached, variant: str) -> None:
    """Sets ``Attachment.conv`` and ``depthwise_conv`` as `variant` names (read when the step is traced)."""
    chosen = {"tfmp, Keras's kernels": conv.KERAS, "tfmp, float32 inside": conv.FLOAT32_INSIDE}.get(variant)
    if chosen is not None:
        attached.conv = attached.depthwise_conv = f"{chosen}: set by the benchmark"


def _trap_facts():
    """This CPU's facts with AVX512_FP16 added (and AVX512_VNNI, which every such CPU has, so
    that TensorFlow's oneDNN counts as on by default): the remapper trap's branch."""
    facts = detect_device_facts()
    return dataclasses.replace(facts, cpu_flags=facts.cpu_flags | {"avx512bw", "avx512_vnni", "avx512_fp16"},
                               onednn_env=None)


def _loop_step(model: keras.Model, loss_fn: Callable) -> Callable:
    optimizer = model.optimizer

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tfmp.scaled_gradients(tape, loss, model.trainable_variables, optimizer)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    def call(x, y):
        with tfmp.step_scope(model):
            return step(x, y)

    return call


def steps(kind: str, sizes: tuple) -> Tuple[Dict[str, Callable[[], object]], Dict[str, str]]:
    """One step callable per variant, each built, compiled and warmed up, and each
    variant's ``Attachment.remapper`` (``"plain Keras"`` for Keras's)."""
    batch, shape, widths = sizes
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, *shape)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(batch,)))
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    found, remapper = {}, {}
    previous = keras.config.dtype_policy()
    try:
        for variant in variants_of(kind):
            with contextlib.ExitStack() as stack:
                if variant.startswith("tfmp"):
                    stack.enter_context(warnings.catch_warnings())
                    warnings.simplefilter("ignore", tfmp.PerformanceWarning)
                    if variant.endswith("remapper off"):
                        stack.enter_context(injected_facts(_trap_facts()))
                    stack.enter_context(tfmp.policy_scope("mixed_float16"))
                else:
                    keras.config.set_dtype_policy("float32" if variant == "float32" else "mixed_float16")
                model = build(kind, shape, widths)
                model.compile(keras.optimizers.SGD(0.01), loss_fn)
            attached = tfmp.attachment(model)
            if attached:
                _set_convolutions(attached, variant)
            remapper[variant] = attached.remapper if attached else "plain Keras"
            if variant == "tfmp loop":
                call = _loop_step(model, loss_fn)
                found[variant] = lambda call=call: call(x, y)
            else:
                found[variant] = lambda model=model: model.train_on_batch(x, y)
            keras.config.set_dtype_policy(previous)
            found[variant]()  # traced and warmed up, not timed
    finally:
        keras.config.set_dtype_policy(previous)
    return found, remapper


def over_budget(callables: Dict[str, Callable[[], object]], budget: float = STEP_BUDGET) -> Dict[str, float]:
    """Variant -> ms of its one step timed alone, for each step over `budget` times float32's.

    Each callable (warmed up) is called once, float32's first; a variant over budget is
    left out of the alternated timing.
    """
    once = {}
    for name, call in callables.items():
        start = time.perf_counter()
        call()
        once[name] = 1e3 * (time.perf_counter() - start)
    return {name: ms for name, ms in once.items() if name != "float32" and ms > budget * once["float32"]}


def measure(quick: bool = False, repeats: Optional[int] = None) -> dict:
    """Step times of every variant per model, with the machine's facts (module docstring)."""
    start = time.perf_counter()
    repeats = repeats or (2 if quick else 9)
    results = {"machine": run.machine(), "quick": quick, "repeats": repeats, "step_budget": STEP_BUDGET,
               "models": {},
               "fused_matmul": float16_fusion.measure(budget_s=0.05 if quick else 1.0).describe(),
               "remapper_trap_by_facts": float16_fusion.remapper_trap("float16") is not None,
               "conv_by_facts": {"conv": conv.decision("float16"),
                                 "depthwise_conv": conv.depthwise_decision("float16")}}
    for kind, sizes in (QUICK_SIZES if quick else SIZES).items():
        callables, remapper = steps(kind, sizes)
        over = over_budget(callables)
        ms = harness.time_alternately({name: call for name, call in callables.items() if name not in over},
                                      repeats, calls=1 if quick else 5)
        rates = {name: [1.0 / t for t in times] for name, times in ms.items()}
        results["models"][kind] = {
            name: {"ms": times, "median_ms": statistics.median(times), "fastest_ms": min(times),
                   "vs_float32": report.ratio_forms(rates[name], rates["float32"]),
                   "remapper": remapper[name]}
            for name, times in ms.items()}
        results["models"][kind].update({
            name: {"ms": [once], "over_budget": True, "remapper": remapper[name]} for name, once in over.items()})
    results["machine"]["load_average_end"] = list(os.getloadavg())
    results["duration_s"] = time.perf_counter() - start
    return results


def markdown(results: dict) -> str:
    """One table per model, with the machine line."""
    by_facts = {field: decided.partition(":")[0] for field, decided in results["conv_by_facts"].items()}
    lines = [report.machine_line(results["machine"], results["duration_s"]),
             f"{results['repeats']} alternated repeats per variant.",
             f"Fused float16 matmul: {results['fused_matmul']}; the trap by this CPU's facts: "
             f"{'yes' if results['remapper_trap_by_facts'] else 'no'}.",
             f"tfmp's float16 convolutions by this CPU's facts: Attachment.conv {by_facts['conv']}, "
             f"depthwise_conv {by_facts['depthwise_conv']}.", ""]
    budget = f"> {results['step_budget']:g}x slower"
    for kind, variants in results["models"].items():
        rows = [[name, f"{v['ms'][0]:.2f} (one step)", "", budget, budget] if v.get("over_budget") else
                [name, f"{v['median_ms']:.2f}", f"{v['fastest_ms']:.2f}",
                 f"{v['vs_float32']['paired']:.3g}x", f"{v['vs_float32']['fastest']:.3g}x"]
                for name, v in variants.items()]
        lines += [f"{kind}:"] + report.table(
            ["variant", "median ms", "fastest ms", "speed vs float32 (paired)",
             "speed vs float32 (fastest)"], rows) + [""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Command line (module docstring); prints the tables and returns the results."""
    return run.simple_main(__doc__, "alternated repeats per variant (default 9; 2 with --quick)",
                           measure, markdown, argv)


if __name__ == "__main__":
    main()
