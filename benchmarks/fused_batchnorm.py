"""Keras's BatchNormalization against TensorFlow's fused kernel; LayerNormalization paths.

One forward and backward pass (``tf.function``, gradient of the sum of the output
with respect to the input, scale and offset) of a 128x32x32x128 NHWC batch
(``--shape``), training mode:

* ``keras_<dtype>``: `keras.layers.BatchNormalization` as Keras 3.15 runs it
  under the policy ``mixed_<dtype>`` (or ``float32``): upcast to float32,
  moments, arithmetic, cast back, moving statistics updated;
* ``fused_<dtype>``: the same layer while `tfmp.enable("mixed_<dtype>")` hooks it
  (``tf.raw_ops.FusedBatchNormV3`` on the 16-bit input, float32 statistics, the
  same moving-statistics update), and ``fused_float32`` on float32 inputs.

LayerNormalization (``--ln-shape``, 64x128x128 as the suite's Transformer):
Keras's layer (``ops.layer_normalization``, computing in float32) against the
fused-batch-norm trick of tf.keras 2 (input reshaped to ``[1, rows, width, 1]``
in NCHW so that each row is a "channel", then scale and offset), both on 16-bit
inputs; the largest difference of the outputs is printed too.

Every variant is traced and warmed up first, then the variants are timed
alternately (order rotated each repeat), each sample the mean of ``--iterations``
calls; reported: the median milliseconds per pass and ratios of medians.

    python benchmarks/fused_batchnorm.py --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tfmp

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmp  # noqa: E402
from benchmarks import harness  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")


def batchnorm_step(dtype: str, fused: bool, shape: Sequence[int]) -> Callable[[], tf.Tensor]:
    """A traced forward+backward pass of one BatchNormalization under ``mixed_<dtype>``."""
    policy = "float32" if dtype == "float32" else f"mixed_{dtype}"
    previous = keras.config.dtype_policy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        if fused:
            tfmp.enable(policy)
        else:
            keras.config.set_dtype_policy(policy)
    try:
        layer = keras.layers.BatchNormalization()
        x = tf.cast(tf.random.stateless_normal(shape, seed=(1, 2)), dtype)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(tf.cast(layer(x, training=True), "float32"))
            return tape.gradient(loss, [x, layer.gamma, layer.beta])

        if fused and dtype == "float32":  # tfmp fuses only under mixed policies: call the kernel path
            from tfmp._src.float32.fused_batchnorm import fused_call

            layer.build(x.shape)

            @tf.function
            def step():  # noqa: F811
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = tf.reduce_sum(fused_call(layer, x, True))
                return tape.gradient(loss, [x, layer.gamma, layer.beta])

        step()  # traced now, while the policy (and tfmp's hook) are in force
    finally:
        tfmp.disable()
        keras.config.set_dtype_policy(previous)
    return step


def layernorm_steps(dtype: str, shape: Sequence[int]) -> Dict[str, Callable[[], tf.Tensor]]:
    """Forward+backward passes of Keras's LayerNormalization and of the fused-batch-norm trick."""
    x = tf.cast(tf.random.stateless_normal(shape, seed=(3, 4)), dtype)
    width = shape[-1]
    gamma = tf.Variable(tf.linspace(0.5, 1.5, width))
    beta = tf.Variable(tf.linspace(-1.0, 1.0, width))

    def keras_ln(v):
        return keras.ops.cast(keras.ops.layer_normalization(
            v, gamma=gamma, beta=beta, epsilon=1e-3), "float32")

    def fused_ln(v):
        rows = tf.size(v) // width
        flat = tf.reshape(v, [1, rows, width, 1])
        ones, zeros = tf.ones([rows]), tf.zeros([rows])
        y = tf.raw_ops.FusedBatchNormV3(
            x=flat, scale=ones, offset=zeros, mean=tf.constant([], tf.float32),
            variance=tf.constant([], tf.float32), epsilon=1e-3, data_format="NCHW",
            is_training=True)[0]
        return tf.reshape(tf.cast(y, "float32"), tf.shape(v)) * gamma + beta

    steps = {}
    for name, fn in (("keras_layernorm", keras_ln), ("fused_trick_layernorm", fused_ln)):
        @tf.function
        def step(fn=fn):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(x) * tf.cast(tf.range(width) % 5, "float32"))
            return tape.gradient(loss, [x, gamma, beta])

        steps[f"{name}_{dtype}"] = step
    gap = float(tf.reduce_max(tf.abs(keras_ln(x) - fused_ln(x))))
    return steps, gap


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Command line; prints a Markdown table of median ms and ratios; returns every sample."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[128, 32, 32, 128])
    parser.add_argument("--ln-shape", type=int, nargs=3, default=[64, 128, 128])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    steps = {}
    for dtype in DTYPES:
        steps[f"keras_{dtype}"] = batchnorm_step(dtype, False, args.shape)
        steps[f"fused_{dtype}"] = batchnorm_step(dtype, True, args.shape)
    gaps = {}
    for dtype in ("bfloat16", "float16"):
        ln_steps, gaps[dtype] = layernorm_steps(dtype, args.ln_shape)
        steps.update(ln_steps)
    for step in steps.values():
        step()  # warm-up (oneDNN primitives)
    # results ready before the clock stops
    samples = harness.time_alternately(steps, args.repeats, args.iterations,
                                       finish=lambda out: float(tf.reduce_sum(tf.cast(out[1], "float32"))))
    median = {name: statistics.median(s) for name, s in samples.items()}
    base = median["keras_float32"]
    print(f"\nBatchNormalization {'x'.join(map(str, args.shape))}, LayerNormalization "
          f"{'x'.join(map(str, args.ln_shape))}, forward+backward, {args.repeats} repeats x "
          f"{args.iterations} calls\n")
    print("| variant | median ms | min ms | vs keras_float32 |")
    print("| --- | --- | --- | --- |")
    for name, ms in median.items():
        ratio = f"{ms / base:.2f}x" if name.startswith(("keras_", "fused_")) and "layernorm" not in name else ""
        print(f"| {name} | {ms:.1f} | {min(samples[name]):.1f} | {ratio} |")
    for dtype in DTYPES:
        print(f"keras / fused {dtype}: {median[f'keras_{dtype}'] / median[f'fused_{dtype}']:.2f}x")
    for dtype, gap in gaps.items():
        ratio = median[f"keras_layernorm_{dtype}"] / median[f"fused_trick_layernorm_{dtype}"]
        print(f"LayerNormalization {dtype}: keras / fused trick {ratio:.2f}x, max |difference| {gap:.2e}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return {"samples": samples, "median_ms": median, "layernorm_max_difference": gaps}


if __name__ == "__main__":
    main()
