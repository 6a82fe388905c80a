"""The Custom Scalars layout of LossScaleMonitor, read back from its event files.

The order of the categories and their closed flags decide TensorBoard's first
screen: under dynamic loss scaling the loss scale and overflows come first;
without loss scaling (a flat scale of 1) the loss, metrics and gradients do.
"""

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


def fit_and_read_layout(log_dir, policy, optimizer="sgd"):
    """Trains a 4-8-1 model for 2 epochs of 2 batches; the layout its monitor wrote."""
    with tfmp.policy_scope(policy):
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 4), dtype="float32"), rng.random((16, 1), dtype="float32")
    monitor = tfmp.LossScaleMonitor(log_dir, update_freq="batch", grad_stats_freq=1)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
    [(_, layout)] = read_run(log_dir)["custom_scalars__config__"]
    return layout


def outline(layout):
    return [(category.title, category.closed) for category in layout.category]


def chart_titles(category):
    return [chart.title for chart in category.chart]


@pytest.mark.parametrize(
    "policy, expected, scale_chart",
    [("mixed_bfloat16", BFLOAT16, "loss scale (batch, fixed at 1)"),
     ("float32", FLOAT32, "loss scale (batch, fixed at 1)"),
     ("mixed_float16", DYNAMIC, "loss scale (batch)")],
)
def test_first_screen_per_policy(tmp_path, policy, expected, scale_chart):
    layout = fit_and_read_layout(tmp_path, policy)
    assert outline(layout) == expected
    by_title = {category.title: category for category in layout.category}
    assert chart_titles(by_title["training"]) == [
        "loss (batch)", "mae (batch)", "loss (epoch)", "mae (epoch)"]
    assert chart_titles(by_title["gradients and updates"]) == [
        "global gradient norm (unscaled)",
        "update / weight (global norms) vs bfloat16's 2**-8",
        "float16 underflow / overflow / zero fractions"]
    [batch_pair] = [c for c in layout.category if c.chart[0].title == scale_chart]
    assert chart_titles(batch_pair) == [scale_chart, "overflow count (batch)"]
    assert list(batch_pair.chart[0].multiline.tag) == ["^batch_loss_scale$"]


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
