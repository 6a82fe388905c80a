"""A user's loss-scaling settings under tfmp.enable(): kept, or their change said once.

`tfmp._src.loss_scale.user_settings`: a Keras `LossScaleOptimizer` given to
``compile()`` becomes tfmp's with the same settings (or, without loss scaling,
a fixed scale of 1.0) and one `tfmp.LossScaleWarning`; loss-scaling options
given for a bfloat16 or float32 policy warn at `enable()`.
"""

import warnings

import keras
import pytest

import tfmp
from tfmp._src.errors import guide
from tfmp._src.loss_scale import optimizer as _loss_scale

# float16 has no arithmetic on this CPU: enable() would say so; these tests only compile.
pytestmark = pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")

RECEIVED = ("tfmp replaced the Keras LossScaleOptimizer(SGD, initial_scale=1024.0, dynamic_growth_steps=100) "
            "given to compile().\n")
TO_KEEP_KERAS = ("\nFix: pass the SGD alone to silence this; compile after tfmp.disable() to keep Keras's optimizer.\n"
                 + "Guide: " + guide("loss-scaling-in-a-custom-train_step"))
KEPT = (RECEIVED + "tfmp.LossScaleOptimizer keeps these settings and adds overflow counters and stuck detection."
        + TO_KEEP_KERAS)
FIXED_AT_1 = (RECEIVED + "A bfloat16 model needs no loss scaling (float32's range): the scale is fixed at 1.0 and "
              "these settings are unused." + TO_KEEP_KERAS)


@pytest.fixture(autouse=True)
def disabled_after():
    yield
    tfmp.disable()


def _model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])


def _compile_recording(model, optimizer):
    """Compiles; returns [(category, message, file)] of the LossScaleWarnings raised."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.compile(optimizer, "mse")
    return [(w.category, str(w.message), w.filename) for w in record
            if issubclass(w.category, tfmp.LossScaleWarning)]


def _keras_lso(initial_scale=1024.0):
    inner = keras.optimizers.SGD(0.01)
    return inner, keras.optimizers.LossScaleOptimizer(inner, initial_scale=initial_scale, dynamic_growth_steps=100)


def test_keras_optimizer_under_float16_keeps_its_settings_in_tfmp_wrapper_and_says_so():
    tfmp.enable("mixed_float16")
    inner, keras_lso = _keras_lso()
    model = _model()
    said = _compile_recording(model, keras_lso)
    assert said == [(tfmp.LossScaleWarning, KEPT, __file__)]  # names the user's compile line
    optimizer = model.optimizer
    assert type(optimizer) is tfmp.LossScaleOptimizer and optimizer.inner_optimizer is inner
    assert (optimizer.loss_scaling, optimizer.initial_scale, optimizer.dynamic_growth_steps) == (True, 1024.0, 100)


def test_each_keras_optimizer_is_warned_about_once():
    _, keras_lso = _keras_lso()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = _loss_scale.wrap_optimizer(keras_lso, "float16")
        second = _loss_scale.wrap_optimizer(keras_lso, "float16")
    assert [str(w.message) for w in record] == [KEPT]
    assert first.initial_scale == second.initial_scale == 1024.0


def test_loss_scale_options_win_over_the_keras_optimizer_and_the_warning_names_them():
    tfmp.enable("mixed_float16", loss_scale_options={"initial_scale": 256.0})
    _, keras_lso = _keras_lso()
    model = _model()
    [(_, message, _)] = _compile_recording(model, keras_lso)
    assert message == KEPT.replace("keeps these settings", "keeps these but initial_scale=256.0 (from tfmp.enable)")
    assert (model.optimizer.initial_scale, model.optimizer.dynamic_growth_steps) == (256.0, 100)


def test_a_keras_scale_above_tfmp_default_bound_is_kept_not_refused():
    tfmp.enable("mixed_float16")
    _, keras_lso = _keras_lso(initial_scale=2.0**30)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.LossScaleWarning)
        model.compile(keras_lso, "mse")
    assert (model.optimizer.loss_scale, model.optimizer.max_scale, model.optimizer.min_scale) == (2.0**30, 2.0**30, 1.0)


def test_keras_optimizer_under_bfloat16_gets_a_fixed_scale_and_the_warning_says_what_is_unused():
    tfmp.enable("mixed_bfloat16")
    _, keras_lso = _keras_lso()
    model = _model()
    assert _compile_recording(model, keras_lso) == [(tfmp.LossScaleWarning, FIXED_AT_1, __file__)]
    assert (model.optimizer.loss_scaling, model.optimizer.loss_scale) == (False, 1.0)


def test_keras_optimizer_under_bfloat16_scales_when_asked():
    tfmp.enable("mixed_bfloat16", loss_scale_options={"loss_scaling": True})
    _, keras_lso = _keras_lso()
    model = _model()
    [(_, message, _)] = _compile_recording(model, keras_lso)
    assert message == KEPT
    assert (model.optimizer.loss_scaling, model.optimizer.loss_scale) == (True, 1024.0)


@pytest.mark.parametrize("policy, scaling", [("mixed_float16", True), ("mixed_bfloat16", False)])
def test_a_plain_optimizer_is_wrapped_as_before_without_a_word(policy, scaling):
    tfmp.enable(policy)
    inner = keras.optimizers.SGD(0.01)
    model = _model()
    assert _compile_recording(model, inner) == []
    assert model.optimizer.inner_optimizer is inner
    assert (model.optimizer.loss_scaling, model.optimizer.loss_scale) == (scaling, 2.0**15 if scaling else 1.0)


def test_a_float32_model_keeps_a_keras_optimizer_untouched():
    tfmp.enable("float32")
    _, keras_lso = _keras_lso()
    model = _model()
    assert _compile_recording(model, keras_lso) == []
    assert model.optimizer is keras_lso


def test_scaling_options_under_bfloat16_warn_at_enable_naming_them():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tfmp.enable("mixed_bfloat16", loss_scale_options={"initial_scale": 2.0**10, "dynamic_growth_steps": 50,
                                                          "max_consecutive_overflows": 4})
    assert [(w.category, str(w.message), w.filename) for w in record
            if w.category is not tfmp.PerformanceWarning] == [(
        tfmp.LossScaleWarning,
        "tfmp.enable(loss_scale_options=...) sets initial_scale=1024.0, dynamic_growth_steps=50, which "
        "policy 'mixed_bfloat16' does not use.\nA bfloat16 model needs no loss scaling (float32's range): "
        "tfmp fixes the scale at 1.0 and still skips non-finite steps.\nFix: add 'loss_scaling': True to "
        "scale anyway, or 'loss_scaling': False to keep 1.0 silently.\n"
        "Guide: " + guide("loss-scaling-in-a-custom-train_step"),
        __file__,
    )]
    model = _model()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    assert (model.optimizer.loss_scale, model.optimizer.max_consecutive_overflows) == (1.0, 4)


@pytest.mark.parametrize("options, scale", [
    ({"initial_scale": 2.0**10, "loss_scaling": True}, 2.0**10),
    ({"initial_scale": 2.0**10, "loss_scaling": False}, 1.0),
    ({"max_consecutive_overflows": 4}, 1.0),  # not a scaling setting
])
def test_scaling_options_said_explicitly_under_bfloat16_do_not_warn(options, scale):
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfmp.LossScaleWarning)
        tfmp.enable("mixed_bfloat16", loss_scale_options=options)
        model = _model()
        model.compile(keras.optimizers.SGD(0.01), "mse")
    assert model.optimizer.loss_scale == scale


def test_scaling_options_under_float16_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfmp.LossScaleWarning)
        tfmp.enable("mixed_float16", loss_scale_options={"initial_scale": 2.0**10})
    model = _model()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    assert model.optimizer.loss_scale == 2.0**10
