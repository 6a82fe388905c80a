"""Building, warming up and timing one workload under each configuration.

Configurations (`CONFIGS`):

* ``float32``: the Keras global policy set to ``"float32"``, plain `compile`.
* ``keras_mixed``: plain Keras with the recommended mixed policy, as the Keras
  mixed-precision guide does it: ``keras.config.set_dtype_policy(policy)`` and
  a plain `compile` (Keras wraps the optimizer itself only for float16).
* ``tfmp``: ``tfmp.enable("auto")`` (or the policy of ``run.py --policy``) before
  building, `compile` under tfmp (float32
  forcing, `tfmp.LossScaleOptimizer`), the train step traced while enabled (so
  BatchNormalization takes the fused kernel under a mixed policy), and `fit` with
  ``tfmp.LossScaleMonitor(update_freq=100)``.
* ``fused_bn`` (`BN_CONFIGS`, the "Keras BatchNormalization vs fused" line):
  ``keras_mixed``, with the model called once inside ``tfmp.policy_scope(policy)``
  before it is compiled plainly (its BatchNormalization layers attach at that
  first call): only BatchNormalization's kernel differs.

Side experiments (`benchmarks/side_experiments.py`) vary a configuration with
`Overrides`: XLA, tfmp's policy, tfmp's guard or monitor on plain Keras, Grappler
options around each call.

Each configuration builds its own model; the global policy is restored and
`tfmp.disable()` called right after its warm-up (whose first step traces the
train step), so the next one starts clean.
Models stay alive so that timed runs of the configurations can alternate (the
same share of any background load falls on each).

What is timed: `model.fit` on the cached dataset, from the end of the first step
of each call to the end of its last step (wall clock, `time.perf_counter`), so
tracing, iterator start-up and epoch-end work are excluded. Warm-up steps (the
first of which traces the train function) run before any timed call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from typing import Callable, Iterator, List, Mapping, Optional, Tuple, Union

import keras
import numpy as np
import tensorflow as tf

import tfmp
from tfmp._src.float32 import bias_gradient, fused_batchnorm, gelu
from tfmp._src.layer_tree import walk
from tfmp._src.errors import invalid_argument
from benchmarks.memory import PeakDeviceMemory, model_memory
from benchmarks.workloads import Workload

CONFIGS = ("float32", "keras_mixed", "tfmp")
#: The "Keras BatchNormalization vs fused" comparison: plain Keras under a mixed
#: policy, and the same with the train step traced while tfmp is enabled.
BN_CONFIGS = ("keras_mixed", "fused_bn")
MONITOR_UPDATE_FREQ = 100


@dataclasses.dataclass(frozen=True)
class Overrides:
    """Departures from a configuration's defaults, for side experiments.

    The defaults leave the configuration as the suite runs it.

    Attributes:
        jit_compile: Bool or ``"auto"``. `compile`'s argument (Keras's "auto"
            turns XLA off on a machine without accelerators).
        tfmp_policy: String. The policy ``tfmp`` enables (the suite: ``"auto"``).
        guard: Bool. Under a plain configuration, wrap Adam in
            ``tfmp.LossScaleOptimizer(loss_scaling=False)`` (its default guard):
            tfmp's optimizer (its guard, Adam's update on the fused kernel)
            without the rest of tfmp.
        monitor: Bool or None. Train with ``tfmp.LossScaleMonitor(update_freq=
            MONITOR_UPDATE_FREQ)``; None: only under ``tfmp``.
        grappler: Dict of option name -> bool, or None. Grappler options
            (`tf.config.optimizer.set_experimental_options`) in force around each
            call of the model (warm-up included), previous values restored after.
        exclude_float32: Tuple of layer path patterns (strings, so that the
            report's JSON holds them). Under ``tfmp``, layers tfmp must not force
            (`tfmp.enable`'s ``exclude_float32``).
        gelu_float32_inside: Bool or None. Under ``tfmp``, whether the model's
            16-bit exact GELU is computed in float32 inside (set on its attachment
            after it compiles); None: as tfmp decides for this machine.
        bias_gradient_summed: Bool or None. Under ``tfmp``, whether the model's
            16-bit bias gradients are summed with float32 accumulation (the bias
            gradient check's result injected while it compiles); None: as this
            CPU's check decides.
        speedups_off: Tuple of speed feature names (`tfmp.enable`'s ``speedups``) turned off under ``tfmp``.
        bias_gradient_conv2d: Bool. With `bias_gradient_summed`, whether a
            Conv2D's bias gradient is summed too (injected as if oneDNN's fused
            kernel lost the sum); False: it keeps that kernel, as tfmp decides
            where the kernel is exact.
    """

    jit_compile: Union[bool, str] = "auto"
    tfmp_policy: str = "auto"
    guard: bool = False
    monitor: Optional[bool] = None
    grappler: Optional[Mapping[str, bool]] = None
    exclude_float32: Tuple[str, ...] = ()
    gelu_float32_inside: Optional[bool] = None
    bias_gradient_summed: Optional[bool] = None
    bias_gradient_conv2d: bool = False
    speedups_off: Tuple[str, ...] = ()


@contextlib.contextmanager
def grappler_options(options: Optional[Mapping[str, bool]]) -> Iterator[None]:
    """Sets Grappler `options` for the calls inside, then restores the previous values.

    The options are process-wide but read at each call of a `tf.function`: TensorFlow
    passes the current ones with every call (the call op's ``config_proto``) and
    optimizes a function once per distinct set, so toggling them between calls of
    already built models gives each call the options in force (checked on
    TensorFlow 2.21 with ``auto_mixed_precision_onednn_bfloat16``).

    Args:
        options: Dict of option name -> bool, or None (nothing changed).

    Yields:
        None. On exit an option that was unset before is set to False (off).
    """
    if not options:
        yield
        return
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options(dict(options))
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options(
            {name: before.get(name, False) for name in options})


class StepClock(keras.callbacks.Callback):
    """Records `time.perf_counter()` at the end of every training step.

    Attributes:
        times: List of floats, seconds, one per step of the last `fit` call.
    """

    def __init__(self) -> None:
        super().__init__()
        self.times: List[float] = []

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.times = []

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.times.append(time.perf_counter())

    def seconds_per_step(self) -> float:
        """Float. Mean seconds per step after the first of the last call."""
        if len(self.times) < 2:
            raise RuntimeError("StepClock needs at least two steps of one fit call.")
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)


@dataclasses.dataclass
class ConfiguredRun:
    """A compiled model of one workload under one configuration, warmed up.

    Attributes:
        config: String. One of `CONFIGS`.
        policy: String. The model's dtype policy name as built.
        model: Compiled `keras.Model`.
        dataset: `tf.data.Dataset` it trains on.
        callbacks: List of Keras callbacks of this configuration, plus the clock.
        clock: `StepClock` among `callbacks`.
        memory: Dict of byte counts (see `benchmarks.memory`).
        fused_batchnorm: ``[fused, total]``: BatchNormalization layers whose
            traced call took TensorFlow's fused kernel, and all of them.
        grappler: Dict or None. Grappler options of every call (`Overrides`).
    """

    config: str
    policy: str
    model: keras.Model
    dataset: tf.data.Dataset
    callbacks: list
    clock: StepClock
    memory: dict
    fused_batchnorm: List[int] = dataclasses.field(default_factory=lambda: [0, 0])
    grappler: Optional[Mapping[str, bool]] = None

    def train(self, steps: int) -> float:
        """Trains `steps` + 1 steps and returns the seconds per step after the first.

        Args:
            steps: Int >= 1. Steps that are timed.

        Returns:
            Float. Mean wall-clock seconds per timed step.
        """
        with grappler_options(self.grappler):
            self.model.fit(
                self.dataset, epochs=1, steps_per_epoch=steps + 1, verbose=0, shuffle=False,
                callbacks=self.callbacks,
            )
        return self.clock.seconds_per_step()


def _build_compile_and_warm_up(
    workload: Workload, config: str, policy: str, warm_up: Callable[[keras.Model], None],
    overrides: Overrides,
) -> keras.Model:
    """Builds and compiles under `config`, runs `warm_up(model)`, then restores the global state.

    The warm-up traces the train step, so it runs while the configuration is in
    force: under ``tfmp`` tfmp stays enabled until the step is traced, as in a
    user's script. ``fused_bn`` builds under `policy`, calls the model once inside
    ``tfmp.policy_scope(policy)`` (its BatchNormalization layers attach at that
    first call and keep the fused kernel) and compiles plainly: it differs from
    ``keras_mixed`` in the BatchNormalization kernel alone. `overrides` change the policy tfmp enables,
    the optimizer and `jit_compile`.
    """
    previous = keras.config.dtype_policy()
    try:
        if config == "tfmp":
            with warnings.catch_warnings():  # an explicit policy may be emulated on this CPU
                warnings.simplefilter("ignore", tfmp.PerformanceWarning)
                tfmp.enable(overrides.tfmp_policy, exclude_float32=overrides.exclude_float32,
                            speedups=dict.fromkeys(overrides.speedups_off, False))
        else:
            keras.config.set_dtype_policy("float32" if config == "float32" else policy)
        model = workload.build()
        if config == "fused_bn":  # a first call while enabled attaches the uncompiled model's layers
            with warnings.catch_warnings(), tfmp.policy_scope(policy):  # 16 bits emulated on some CPUs
                warnings.simplefilter("ignore")
                model(workload.inputs(1, np.random.default_rng(0))[0][:1], training=False)
        optimizer = keras.optimizers.Adam(1e-3)
        if overrides.guard:
            optimizer = tfmp.LossScaleOptimizer(optimizer, loss_scaling=False)
        with contextlib.ExitStack() as injected:
            if overrides.bias_gradient_summed is not None:
                injected.enter_context(bias_gradient.injected(
                    loses=overrides.bias_gradient_summed, conv2d_loses=overrides.bias_gradient_conv2d))
            model.compile(
                optimizer=optimizer,
                loss=workload.compile_loss(),
                jit_compile=overrides.jit_compile,
            )
        if overrides.gelu_float32_inside is not None:  # the decision, set on the model's attachment
            chosen = gelu.FLOAT32_INSIDE if overrides.gelu_float32_inside else gelu.KERAS
            tfmp.attachment(model).gelu = f"{chosen}: set by the side experiment"
        warm_up(model)
    finally:
        tfmp.disable()
        keras.config.set_dtype_policy(previous)
    return model


def prepare(
    workload: Workload, config: str, policy: str, log_dir: str, warmup_steps: int,
    overrides: Overrides = Overrides(),
) -> ConfiguredRun:
    """Builds, compiles and warms up `workload` under `config`.

    Args:
        workload: `Workload`.
        config: String. One of `CONFIGS` or ``"fused_bn"``.
        policy: String. The recommended mixed policy (used by ``keras_mixed``
            and ``fused_bn``).
        log_dir: String. Root folder for the tfmp monitor's event files.
        warmup_steps: Int >= 2. Untimed steps; the first traces the train step.
        overrides: `Overrides`. Departures from `config` (none by default).

    Returns:
        `ConfiguredRun`, with its clock holding the warm-up steps' times.

    Raises:
        ValueError: `config` is not one of `CONFIGS` or ``"fused_bn"``.
    """
    if config not in CONFIGS + BN_CONFIGS:
        choices = CONFIGS + BN_CONFIGS[1:]
        raise invalid_argument("config", config, f"one of {choices}", choices=choices)
    peak = PeakDeviceMemory()
    clock = StepClock()
    callbacks: list = []
    if overrides.monitor or (overrides.monitor is None and config == "tfmp"):
        monitor_dir = os.path.join(log_dir, workload.name)
        callbacks.append(tfmp.LossScaleMonitor(monitor_dir, update_freq=MONITOR_UPDATE_FREQ))
    callbacks.append(clock)
    runs: List[ConfiguredRun] = []

    def warm_up(model: keras.Model) -> None:
        run = ConfiguredRun(
            config, model.dtype_policy.name, model, workload.dataset(), callbacks, clock, {},
            grappler=overrides.grappler,
        )
        run.train(warmup_steps - 1)
        runs.append(run)

    model = _build_compile_and_warm_up(workload, config, policy, warm_up, overrides)
    run = runs[0]
    run.memory = model_memory(model, workload.batch_size)
    run.memory["peak_device_bytes"] = peak.read()
    run.fused_batchnorm = fused_batchnorm_count(model)
    return run


def fused_batchnorm_count(model: keras.Model) -> List[int]:
    """``[fused, total]`` BatchNormalization layers of `model`; fused: its last traced call took the kernel."""
    layers = [layer for _, layer, _ in walk(model) if isinstance(layer, keras.layers.BatchNormalization)]
    return [sum(fused_batchnorm.last_call_reason(layer) == "" for layer in layers), len(layers)]


def calibrate_steps(
    seconds_per_step: float, target_seconds: float, min_steps: int, max_steps: int
) -> int:
    """Steps per timed call so that one call lasts about `target_seconds`.

    Args:
        seconds_per_step: Float > 0. Measured step time of the slowest config.
        target_seconds: Float. Wanted duration of one timed call.
        min_steps: Int. Lower bound.
        max_steps: Int. Upper bound.

    Returns:
        Int in [min_steps, max_steps].
    """
    wanted = int(round(target_seconds / max(seconds_per_step, 1e-9)))
    return max(min_steps, min(max_steps, wanted))


def time_alternately(
    steps: Mapping[str, Callable[[], object]], repeats: int, calls: int,
    finish: Callable[[object], object] = lambda out: None,
) -> dict:
    """Milliseconds per call of each step, the steps alternated, the order rotated each repeat.

    Args:
        steps: Dict name -> callable without arguments (traced and warmed up already).
        repeats: Int >= 1. Samples per step.
        calls: Int >= 1. Calls per sample.
        finish: Callable given the last call's result of each sample before the
            clock stops (e.g. to wait for the results).

    Returns:
        Dict name -> list of `repeats` floats, ms per call.
    """
    names = list(steps)
    samples: dict = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            start = time.perf_counter()
            for _ in range(calls):
                out = steps[name]()
            finish(out)
            samples[name].append(1e3 * (time.perf_counter() - start) / calls)
    return samples


def matmul_gflops(dtype: str, size: int, iterations: int) -> Callable[[], float]:
    """A timer of ``tf.matmul`` on two `size` x `size` matrices of `dtype`.

    Args:
        dtype: String. ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        size: Int. Matrix side; one product costs 2 * size**3 FLOPs.
        iterations: Int. Products per timed call.

    Returns:
        Callable taking no arguments that runs `iterations` products (after one
        untimed warm-up product on its first call) and returns GFLOP/s.
    """
    a = tf.cast(tf.random.stateless_normal((size, size), seed=(1, 2)), dtype)
    b = tf.cast(tf.random.stateless_normal((size, size), seed=(3, 4)), dtype)
    float(tf.matmul(a, b)[0, 0])  # warm-up: oneDNN primitive creation

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            product = tf.matmul(a, b)
        float(product[0, 0])  # the result is ready before the clock stops
        seconds = time.perf_counter() - start
        return 2.0 * size**3 * iterations / seconds / 1e9

    return timed
