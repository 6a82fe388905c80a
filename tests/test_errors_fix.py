"""Every refusal of a public argument says how to fix it (tfmp/_src/errors.py's template).

Each case calls a public name with one bad value and checks three written-down
parts of the message: what was received, what was expected, and the fix (what
to pass instead, with an example value).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.advisors.compare_report import RunResult


@pytest.fixture(scope="module")
def model():
    """Input(3) -> Dense(4, name="out"), built and called once."""
    built = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="out")])
    built(np.zeros((1, 3), "float32"))
    return built


def sgd():
    return keras.optimizers.SGD()


def enabled(policy, **options):
    """`tfmp.enable`, disabled again whether or not it raised."""
    try:
        tfmp.enable(policy, **options)
    finally:
        tfmp.disable()


def compare_report():
    runs = tuple(RunResult(policy, policy, {"accuracy": [0.5]}, 1.0, 32.0, 3, 4.0, 10.0)
                 for policy in ("float32", "mixed_bfloat16"))
    return tfmp.CompareReport(runs=runs, tolerance=0.5, settings={})


X = np.ones((4, 3), "float32")

# (id, call of (model, tmp_path), received, expected, fix): the parts the message must hold.
CASES = [
    # Loss scaling: guard, scales and their bounds, counts, choices, flags, unknown keywords.
    ("guard-int", lambda m, t: tfmp.LossScaleOptimizer(sgd(), guard=5),
     "Received: guard=5 (of type int).", "Expected one of 'auto', 'batch', 'loss', 'gradients', 'values'.",
     "Pass e.g. guard='auto' (the default: 'gradients' with loss scaling, 'batch' without)."),
    ("guard-enable", lambda m, t: enabled("float32", loss_scale_options={"guard": "everything"}),
     "Received: guard='everything' (of type str).", "Expected one of 'auto', 'batch',",
     "Pass e.g. guard='auto'"),
    ("min_scale-zero", lambda m, t: tfmp.LossScaleOptimizer(sgd(), min_scale=0),
     "Received: min_scale=0 (of type int).", "Expected a finite number > 0.",
     "Pass e.g. min_scale=1.0 (the default)."),
    ("max_scale-string", lambda m, t: tfmp.LossScaleOptimizer(sgd(), max_scale="big"),
     "Received: max_scale='big' (of type str).", "Expected a finite number > 0.",
     "Pass e.g. max_scale=2.0**24 (the default)."),
    ("initial_scale-nan", lambda m, t: tfmp.LossScaleOptimizer(sgd(), initial_scale=float("nan")),
     "Received: initial_scale=nan (of type float).", "Expected a finite number > 0.",
     "Pass e.g. initial_scale=2.0**15 (the default)."),
    ("min_scale-above-max", lambda m, t: tfmp.LossScaleOptimizer(sgd(), min_scale=64.0, max_scale=32.0),
     "Received: min_scale=64.0 (of type float).", "Expected a value <= max_scale=32.0.",
     "Pass e.g. min_scale=32.0, initial_scale=32.0 with max_scale=32.0."),
    ("max_scale-below-default-min", lambda m, t: tfmp.LossScaleOptimizer(sgd(), max_scale=0.5),
     "Received: max_scale=0.5 (of type float).", "Expected a value >= min_scale=1.0.",
     "Pass e.g. min_scale=0.5, initial_scale=0.5 with max_scale=0.5."),
    ("initial_scale-below-min", lambda m, t: tfmp.LossScaleOptimizer(sgd(), initial_scale=2.0, min_scale=4.0),
     "Received: initial_scale=2.0 (of type float).", "Expected a value in [min_scale, max_scale] = [4.0, 16777216.0].",
     "Pass e.g. initial_scale=4.0, or widen min_scale and max_scale."),
    ("hysteresis-zero", lambda m, t: tfmp.LossScaleOptimizer(sgd(), hysteresis=0),
     "Received: hysteresis=0 (of type int).", "Expected an integer >= 1.", "Pass e.g. hysteresis=1 (the default)."),
    ("on_stuck-none", lambda m, t: tfmp.LossScaleOptimizer(sgd(), on_stuck=None),
     "Received: on_stuck=None (of type NoneType).", "Expected one of 'raise', 'warn'.",
     "Pass on_stuck='raise' (stop the run, the default) or on_stuck='warn'."),
    ("loss_scaling-string", lambda m, t: tfmp.LossScaleOptimizer(sgd(), loss_scaling="yes"),
     "Received: loss_scaling='yes' (of type str).", "Expected True or False.",
     "Pass loss_scaling=True or loss_scaling=False."),
    ("scaled_gradients-variables",
     lambda m, t: tfmp.scaled_gradients(tf.GradientTape(), tf.constant(1.0), "w", sgd()),
     "Received: variables='w' (of type str).",
     "Expected a non-empty list or tuple of variables, e.g. model.trainable_variables.",
     "Pass the variables themselves, e.g. model.trainable_variables, not their names or values."),
    ("unknown-keyword", lambda m, t: tfmp.LossScaleOptimizer(sgd(), zzz=1),
     "Received: zzz=1 (of type int).", "Expected an argument of tfmp.LossScaleOptimizer: one of inner_optimizer,",
     "Unknown argument 'zzz'. Remove it, or use one of those listed."),
    ("loss_scale_options-unknown-key", lambda m, t: enabled("float32", loss_scale_options={"zzz": 1}),
     "Received: loss_scale_options={'zzz': 1} (of type dict).",
     "Expected keys among initial_scale, dynamic_growth_steps,",
     "Unknown key 'zzz'. Remove it, or use one of those listed."),
    # LossScaleMonitor
    ("update_freq-zero", lambda m, t: tfmp.LossScaleMonitor(str(t), update_freq=0),
     "Received: update_freq=0 (of type int).", "Expected 'epoch', 'batch' or a positive int.",
     "Pass update_freq='epoch' (the default), 'batch', or a step count, e.g. update_freq=100."),
    ("update_freq-string", lambda m, t: tfmp.LossScaleMonitor(str(t), update_freq="always"),
     "Received: update_freq='always' (of type str).", "Expected 'epoch', 'batch' or a positive int.",
     "e.g. update_freq=100."),
    # Model arguments that are no model
    ("audit-model", lambda m, t: tfmp.audit(5),
     "Received: model=5 (of type int).", "Expected a keras.Model.",
     "Pass the model itself, e.g. tfmp.audit(model); wrap a single layer first, "
     "e.g. keras.Sequential([keras.Input((4,)), layer])."),
    ("check_numerics-model-none", lambda m, t: tfmp.check_numerics(None),
     "Received: model=None (of type NoneType).", "Expected a keras.Model instance.",
     "Pass the model itself, e.g. tfmp.check_numerics(model, action='warn');"),
    ("to_float32-model", lambda m, t: tfmp.to_float32("model"),
     "Received: model='model' (of type str).", "Expected a built `keras.Model`.",
     "Pass the model itself, e.g. tfmp.to_float32(model);"),
    # check_numerics options
    ("action-int", lambda m, t: tfmp.check_numerics(m, action=1),
     "Received: action=1 (of type int).", "Expected one of 'raise', 'warn', 'log'.",
     "Pass e.g. action='warn' (report and go on); 'raise' (the default) stops the run."),
    ("phase-far", lambda m, t: tfmp.check_numerics(m, phase="sideways"),
     "Received: phase='sideways' (of type str).", "Expected one of 'forward', 'backward', 'both'.",
     "Pass e.g. phase='both' (the default: layer outputs and gradients)."),
    ("layers-unknown", lambda m, t: tfmp.check_numerics(m, layers=["nowhere"]),
     "Received: layers='nowhere' (of type str).", "Expected a layer of model",
     "Pass names from that list, e.g. layers=['out']."),
    ("layers-item", lambda m, t: tfmp.check_numerics(m, layers=[5]),
     "Received: layers=5 (of type int).", "Expected layer names, paths, Layer classes or Layer instances.",
     "Pass e.g. layers=['dense', keras.layers.LayerNormalization]."),
    ("enabled-int", lambda m, t: tfmp.check_numerics(m, enabled=1),
     "Received: enabled=1 (of type int).", "Expected True or False.", "Pass enabled=True or enabled=False."),
    # export
    ("export-format", lambda m, t: tfmp.export(m, str(t / "out"), format=3),
     "Received: format=3 (of type int).", "Expected one of 'tf_saved_model', 'tflite'.",
     "Pass format='tf_saved_model' (a folder, the default) or format='tflite' (a file)."),
    ("export-weights", lambda m, t: tfmp.export(m, str(t / "out.tflite"), format="tflite", weights="int8"),
     "Received: weights='int8' (of type str).", "Expected one of 'float32', 'float16'.",
     "Pass weights='float32' (the default), or weights='float16' with format='tflite'."),
    # check_dataset
    ("check_dataset-list-of-ints", lambda m, t: tfmp.check_dataset([1, 2, 3]),
     "Received: dataset=[1, 2, 3] (of type list).",
     "or an iterable of batches, each an array or tensor of rank >= 1 or a tuple or dict of them.",
     "Batch 0 holds a value of type int, not an array: pass the values as one array, "
     "e.g. np.array([1.0, 2.0, 3.0]), or batches of arrays, e.g. [(x0, y0), (x1, y1)]."),
    ("check_dataset-batch-without-array", lambda m, t: tfmp.check_dataset([(X, None), ()]),
     "Received: dataset=", "an iterable of batches, each an array or tensor of rank >= 1",
     "Batch 1 holds no array: pass the values as one array,"),
    ("check_dataset-policy", lambda m, t: tfmp.check_dataset(X, policy=16),
     "Received: policy=16 (of type int).", "Expected None, a keras.DTypePolicy or one of 'float16',",
     "Pass e.g. policy='mixed_float16', or None for Keras's global policy."),
    ("check_dataset-max_batches", lambda m, t: tfmp.check_dataset(X, max_batches=0),
     "Received: max_batches=0 (of type int).", "Expected an integer >= 1 or None.",
     "Pass e.g. max_batches=100, or None to scan all."),
    ("check_dataset-batch_size", lambda m, t: tfmp.check_dataset(X, batch_size="32"),
     "Received: batch_size='32' (of type str).", "Expected an integer >= 1.",
     "Pass e.g. batch_size=32 (the default)."),
    # Policy, float32 rules, audit
    ("enable-policy", lambda m, t: enabled("qqq"),
     "Received: policy='qqq' (of type str).", "Expected one of 'auto', 'mixed_float16', 'mixed_bfloat16', 'float32'.",
     "Pass e.g. policy='auto' (chosen for this machine)."),
    ("enable-tf32", lambda m, t: enabled("float32", tf32="on"),
     "Received: tf32='on' (of type str).", "Expected None, True or False.",
     "Pass tf32=True, tf32=False or tf32=None."),
    ("policy_decision-reason", lambda m, t: tfmp.PolicyDecision("float32", 5, "CPU"),
     "Received: reason=5 (of type int).", "Expected a string.", "Pass one sentence, e.g. reason="),
    ("unregister-never-registered", lambda m, t: tfmp.unregister_float32("never/registered"),
     "Received: targets='never/registered' (of type str).", "Expected a registered target",
     "Pass a target given to tfmp.register_float32 before, as given there; tfmp.float32_layers() lists them."),
    ("float32_rules-keep", lambda m, t: tfmp.Float32Rules(builtin=(), keep=5, exclude=()),
     "Received: keep=5 (of type int).", "Expected a tuple of Layer classes and pattern strings.",
     "Pass e.g. keep=('head/*', keras.layers.Dense), or keep=() for none."),
    ("audit-tensor_cores", lambda m, t: tfmp.audit(m, tensor_cores="yes"),
     "Received: tensor_cores='yes' (of type str).", "Expected None, True or False.",
     "Pass tensor_cores=True, tensor_cores=False or tensor_cores=None."),
    ("audit_report-fraction", lambda m, t: tfmp.AuditReport("float32", (), (), 2.0),
     "Received: float32_fraction=2.0 (of type float).", "Expected a number in [0, 1].",
     "Pass the share of parameters in forced layers, e.g. float32_fraction=0.25."),
    ("attachment-exact_ids", lambda m, t: tfmp.Attachment("m", "compile", "float32", exact_ids=-1),
     "Received: exact_ids=-1 (of type int).", "Expected an int >= 0.",
     "Pass the number of Embedding layers with exact ids, e.g. exact_ids=0."),
    ("non_finite_error-step", lambda m, t: tfmp.NonFiniteError("m", step="3"),
     "Received: step='3' (of type str).", "Expected an int or None.", "Pass e.g. step=3, or None."),
    # The advisors
    ("compare-epochs", lambda m, t: tfmp.compare(lambda: m, (X, X), epochs=0),
     "Received: epochs=0 (of type int).", "Expected a positive int.", "Pass e.g. epochs=3 (the default)."),
    ("compare-tolerance", lambda m, t: tfmp.compare(lambda: m, (X, X), tolerance=-1.0),
     "Received: tolerance=-1.0 (of type float).", "Expected a finite float >= 0 (percentage points).",
     "Pass e.g. tolerance=0.5 (the default: half a percentage point)."),
    ("verdict-tolerance", lambda m, t: compare_report().verdict(tolerance="wide"),
     "Received: tolerance='wide' (of type str).", "Expected a float >= 0.",
     "Pass e.g. tolerance=0.5 (percentage points), or None for the report's own."),
    ("verdict-metric", lambda m, t: compare_report().verdict(metric="speed"),
     "Received: metric='speed' (of type str).", "Expected a metric the runs recorded.",
     "Choose from: accuracy; e.g. metric='accuracy'."),
    ("kv_cache-size", lambda m, t: tfmp.estimate_kv_cache(0, 4096, 1, 1),
     "Received: num_layers=0 (of type int).", "Expected an integer >= 1.", "Pass e.g. num_layers=32."),
    ("kv_cache-dtype", lambda m, t: tfmp.estimate_kv_cache(2, 8, 4, 1, dtype=5),
     "Received: dtype=5 (of type int).", "Expected a dtype name such as 'float16', 'bfloat16' or 'float32'.",
     "Pass e.g. dtype='float16' (the default)."),
    ("speed_probe-dtype", lambda m, t: tfmp.SpeedProbe(2.0, 1.0, 1.0).step_ms(5),
     "Received: dtype=5 (of type int).", "Expected one of 'float32', 'bfloat16', 'float16'.",
     "Pass e.g. dtype='bfloat16'."),
    ("doctor-as_json", lambda m, t: tfmp.doctor(tfmp.DeviceFacts(), as_json="yes", file=None),
     "Received: as_json='yes' (of type str).", "Expected True or False.", "Pass as_json=True or as_json=False."),
]


@pytest.mark.parametrize("call, received, expected, fix", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_refusal_names_the_value_what_is_expected_and_the_fix(model, tmp_path, call, received, expected, fix):
    with pytest.raises(ValueError) as info:
        call(model, tmp_path)
    message = str(info.value)
    assert message.startswith("Invalid `")
    assert received in message
    assert expected in message
    assert fix in message
    assert message.index(received) < message.index(fix)  # the fix comes last
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


@pytest.mark.parametrize("call, suggestion", [
    (lambda: tfmp.LossScaleOptimizer(sgd(), guard="gradeints"), "Did you mean 'gradients'?"),
    (lambda: tfmp.LossScaleOptimizer(sgd(), on_stuck="rasie"), "Did you mean 'raise'?"),
    (lambda: tfmp.export(None, "out", format="tflight"), "Did you mean 'tflite'?"),
    (lambda: tfmp.enable("Mixed_BFloat16"), "Did you mean 'mixed_bfloat16'?"),  # only the case differs
])
def test_a_typo_gets_the_suggestion_instead_of_the_fix(call, suggestion):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value).endswith(f"(of type str). {suggestion}")


def test_a_policy_alias_gets_its_name_not_a_close_spelling():
    try:
        with pytest.raises(ValueError) as info:
            tfmp.enable("fp16")
    finally:
        tfmp.disable()
    assert str(info.value).endswith("Received: policy='fp16' (of type str). Did you mean 'mixed_float16'?")


def test_check_dataset_still_takes_an_iterable_of_batches():
    x = np.ones((4, 3), "float32")
    x[1, 2] = np.nan
    report = tfmp.check_dataset([(x, np.zeros((4, 1), "float32")), {"a": x}, (x, None)])
    assert [(i.batch, i.component, i.feature, i.problem) for i in report.issues] == [
        (0, "x", 2, "nan"), (1, "x/a", 2, "nan"), (2, "x", 2, "nan")]


@pytest.mark.parametrize("bounds", [dict(min_scale=4.0, max_scale=2.0), dict(max_scale=0.5),
                                    dict(min_scale=64.0, max_scale=32.0, loss_scaling=False)])
def test_following_the_scale_bounds_fix_gives_a_valid_optimizer(bounds):
    """The fix names every bound to change at once: passing it is accepted, with no second error."""
    import re

    with pytest.raises(ValueError) as info:
        tfmp.LossScaleOptimizer(sgd(), **bounds)
    fix = re.search(r"Pass e\.g\. (.*) with max_scale=(\S+)\.$", str(info.value))
    fixed = dict(bounds, max_scale=float(fix.group(2)))
    for pair in fix.group(1).split(", "):
        name, value = pair.split("=")
        fixed[name] = float(value)
    optimizer = tfmp.LossScaleOptimizer(sgd(), **fixed)
    assert optimizer.loss_scale <= fixed["max_scale"]
