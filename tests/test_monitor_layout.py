"""The Custom Scalars layout of LossScaleMonitor, read back from its event files.

The order of the categories and their closed flags decide the Custom Scalars
tab's first screen: under dynamic loss scaling the loss scale and overflows come
first; without loss scaling (a flat scale of 1) the loss, metrics and gradients
do. The tags' groups decide the Time Series tab's (TensorBoard's default): the
loss and metrics first under every policy.
"""

import re

import keras
import numpy as np
import pytest
from _events import read_run

import tfmp
from tfmp._src.monitor.layout import build_layout

# float16 has no arithmetic on this CPU; the mixed_float16 case runs it emulated.
pytestmark = pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")

TRAINING = ("training", False)
GRADIENTS = ("gradients and updates", False)
DETAILS_OPEN = ("loss scaling: details", False)
DETAILS_CLOSED = ("loss scaling: details", True)
THROUGHPUT = ("throughput", True)
DYNAMIC = [("loss scaling (batch)", False), ("loss scaling (epoch)", False),
           TRAINING, GRADIENTS, DETAILS_OPEN, THROUGHPUT]
BFLOAT16 = [TRAINING, GRADIENTS,
            ("loss scale (batch, fixed at 1: no loss scaling under mixed_bfloat16)", True),
            ("loss scale (epoch, fixed at 1: no loss scaling under mixed_bfloat16)", True),
            DETAILS_CLOSED, THROUGHPUT]
FLOAT32 = [TRAINING, GRADIENTS,
           ("loss scale (batch, fixed at 1: no loss scaling under float32)", True),
           ("loss scale (epoch, fixed at 1: no loss scaling under float32)", True),
           DETAILS_CLOSED, THROUGHPUT]


def fit_and_read(log_dir, policy, optimizer="sgd"):
    """Trains a 4-8-1 model for 2 epochs of 2 batches; the events its monitor wrote.

    Seeded layers, and under float16 a scale of 2**8, so that no step overflows.
    """
    options = {"loss_scale_options": {"initial_scale": 2.0**8}} if policy == "mixed_float16" else {}
    init = keras.initializers.GlorotUniform
    with tfmp.policy_scope(policy, **options):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, kernel_initializer=init(seed=1)),
                                  keras.layers.Dense(1, kernel_initializer=init(seed=2))])
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 4), dtype="float32"), rng.random((16, 1), dtype="float32")
    monitor = tfmp.LossScaleMonitor(log_dir, update_freq="batch", grad_stats_freq=1)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
    return read_run(log_dir)


def fit_and_read_layout(log_dir, policy, optimizer="sgd"):
    """The layout the monitor of `fit_and_read` wrote."""
    [(_, layout)] = fit_and_read(log_dir, policy, optimizer)["custom_scalars__config__"]
    return layout


def time_series_groups(run):
    """The card groups of TensorBoard's Time Series tab, in its order: the scalar tags'
    prefixes before the first "/" (a tag without one is its own group), sorted by name."""
    scalars = [tag for tag, points in run.items() if isinstance(points[0][1], float)]
    return list(dict.fromkeys(tag.split("/")[0] for tag in sorted(scalars)))


def outline(layout):
    return [(category.title, category.closed) for category in layout.category]


def chart_titles(category):
    return [chart.title for chart in category.chart]


FLOAT16_CHART = "float16 underflow / overflow / zero fractions"
FRACTIONS = {"precision/grad_underflow_fraction", "precision/grad_overflow_fraction",
             "precision/grad_zero_fraction"}


@pytest.mark.parametrize(
    "policy, expected, scale_chart",
    [("mixed_bfloat16", BFLOAT16, "loss scale (batch, fixed at 1)"),
     ("float32", FLOAT32, "loss scale (batch, fixed at 1)"),
     ("mixed_float16", DYNAMIC, "loss scale (batch)")],
)
def test_first_screen_per_policy(tmp_path, policy, expected, scale_chart):
    run = fit_and_read(tmp_path, policy)
    [(_, layout)] = run["custom_scalars__config__"]
    assert outline(layout) == expected
    by_title = {category.title: category for category in layout.category}
    assert chart_titles(by_title["training"]) == [
        "loss (batch)", "mae (batch)", "loss (epoch)", "mae (epoch)"]
    float16 = policy == "mixed_float16"
    assert chart_titles(by_title["gradients and updates"]) == [
        "global gradient norm (unscaled)",
        "update / weight (global norms) vs bfloat16's 2**-8"] + ([FLOAT16_CHART] if float16 else [])
    [batch_pair] = [c for c in layout.category if c.chart[0].title == scale_chart]
    assert chart_titles(batch_pair) == [scale_chart, "overflow count (batch)"]
    assert list(batch_pair.chart[0].multiline.tag) == ["^precision/batch_loss_scale$"]
    # Every chart draws tags the run holds (none is left empty by a rename), but the
    # overflow events (points at skipped steps only, and no step was skipped) and,
    # under float32, the counts its plain SGD does not keep.
    counted = policy != "float32"
    for category in layout.category:
        for chart in category.chart:
            if chart.title == "overflow events (scale that overflowed)" or (
                    not counted and "overflow" in chart.multiline.tag[0] + chart.multiline.tag[-1]):
                assert not any(re.fullmatch(chart.multiline.tag[0], tag) for tag in run)
                continue
            for regex in chart.multiline.tag:
                assert any(re.fullmatch(regex, tag) for tag in run), (chart.title, regex)
    # The float16 diagnostics are written for a float16 model only.
    assert (FRACTIONS <= set(run)) if float16 else not (FRACTIONS & set(run))
    # The Time Series tab (TensorBoard's default) opens on the loss and metrics.
    assert time_series_groups(run) == ["metrics", "optimizer", "precision", "system"]
    first_cards = sorted(tag for tag in run if tag.startswith("metrics/"))
    assert first_cards == ["metrics/batch_loss", "metrics/batch_mae", "metrics/epoch_loss",
                           "metrics/epoch_mae"]


def test_the_optimizer_decides_not_the_policy_name(tmp_path):
    # float32 with a dynamic scale: the scale moves, so it comes first.
    dynamic = tfmp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=2.0**10)
    assert outline(fit_and_read_layout(tmp_path / "dynamic", "float32", dynamic)) == DYNAMIC
    # tfmp's fixed-scale guard: no loss scaling, so it follows.
    fixed = tfmp.LossScaleOptimizer(keras.optimizers.SGD(), loss_scaling=False)
    assert outline(fit_and_read_layout(tmp_path / "fixed", "float32", fixed)) == FLOAT32


def test_fixed_scale_stays_open_when_nothing_else_is_drawn():
    # No metrics and no gradient statistics: closing the scale would leave no chart open.
    layout = build_layout(("epoch_",), False, (), fixed_scale="no loss scaling under float32")
    assert outline(layout) == [
        ("loss scale (epoch, fixed at 1: no loss scaling under float32)", False),
        DETAILS_OPEN, THROUGHPUT]
    assert chart_titles(layout.category[0]) == [
        "loss scale (epoch, fixed at 1)", "overflow count (epoch)"]
