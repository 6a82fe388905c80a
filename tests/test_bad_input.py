"""Bad input to the policy, float32, loss-scale, monitor, numerics, audit and attachment names.

Each test draws wrong values with hypothesis (`_bad_input`) and checks that the
public call refuses them with the template error naming the argument, leaving
tfmp and Keras as they were; where a value that looks wrong is handled, the
test checks the result against a value written down here.
"""

import string
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from _machines import ZEN4

import tfmp
from _bad_input import (
    BAD_INPUT_SETTINGS,
    NEGATIVE_OR_ZERO_INTS,
    NON_BOOLS,
    NON_FINITE,
    NON_NUMBERS,
    NON_STRINGS,
    NOT_MODELS,
    assert_refused,
    covers,
)
from tfmp._src.policy import enable as enable_module
from tfmp._src.policy import speedups

MIXED_NAMES = ("auto", "mixed_float16", "mixed_bfloat16", "float32", "float16", "bfloat16")
#: Strings that are no policy name (aliases like "fp16" included: they are refused with a hint).
NOT_POLICY_NAMES = st.text(max_size=8).filter(lambda s: s not in MIXED_NAMES)
#: A layer instance, where a Layer class is expected.
A_LAYER = keras.layers.Dense(2, name="an_instance")
#: Wrong `keep_float32`/`keep`/`targets` values: not a Layer class, not a non-empty pattern.
NOT_TARGETS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.just(""), st.builds(object),
    st.just(A_LAYER), st.lists(st.integers(), min_size=1, max_size=3),
)
NOT_OPTIMIZERS = st.one_of(NOT_MODELS, st.sampled_from(["adam", "sgd"]))
NOT_POSITIVE_NUMBERS = st.one_of(NON_NUMBERS, NON_FINITE, st.floats(max_value=0.0), st.integers(max_value=0))
NOT_COUNTS = st.one_of(NEGATIVE_OR_ZERO_INTS, st.floats(), st.text(max_size=3), st.booleans(), st.none())
NOT_DICTS = st.one_of(st.booleans(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3),
                      st.builds(object))
IDENTIFIERS = st.text(string.ascii_lowercase + "_", min_size=1, max_size=10)


@pytest.fixture(scope="module")
def model():
    """A built float32 model: Input(3) -> Dense(4, name="out")."""
    keras.config.set_dtype_policy("float32")
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="out")])


def refused_without_change(call, argument):
    """`assert_refused`, then: tfmp not enabled and the Keras global policy as before."""
    before = keras.config.dtype_policy().name
    assert_refused(call, argument)
    assert not enable_module.is_enabled()
    assert keras.config.dtype_policy().name == before


def in_scope(**arguments):
    with tfmp.policy_scope(**arguments) as decision:
        return decision


# enable, disable, policy_scope, recommend_policy, PolicyDecision

@covers("enable", "policy_scope")
@given(policy=st.one_of(NOT_POLICY_NAMES, NON_STRINGS))
@BAD_INPUT_SETTINGS
def test_enable_and_scope_refuse_a_policy(policy):
    refused_without_change(lambda: tfmp.enable(policy), "policy")
    refused_without_change(lambda: in_scope(policy=policy), "policy")


@covers("enable", "policy_scope")
@given(targets=NOT_TARGETS, argument=st.sampled_from(["keep_float32", "exclude_float32"]))
@BAD_INPUT_SETTINGS
def test_enable_and_scope_refuse_float32_targets(targets, argument):
    refused_without_change(lambda: tfmp.enable("float32", **{argument: targets}), argument)
    refused_without_change(lambda: in_scope(policy="float32", **{argument: targets}), argument)


@covers("enable")
@given(flag=NON_BOOLS, argument=st.sampled_from(["allow_pure_16bit", "tf32", "verbose"]))
@BAD_INPUT_SETTINGS
def test_enable_refuses_flags(flag, argument):
    refused_without_change(lambda: tfmp.enable("float32", **{argument: flag}), argument)


@covers("enable")
@given(options=st.one_of(NOT_DICTS, st.dictionaries(IDENTIFIERS.filter(lambda k: k not in (
    "initial_scale", "dynamic_growth_steps", "min_scale", "max_scale", "hysteresis",
    "max_consecutive_overflows", "on_stuck", "loss_scaling", "guard", "name")), st.integers(), min_size=1,
    max_size=2)))
@BAD_INPUT_SETTINGS
def test_enable_refuses_loss_scale_options(options):
    refused_without_change(lambda: tfmp.enable("float32", loss_scale_options=options), "loss_scale_options")


@covers("enable")
@given(value=NOT_POSITIVE_NUMBERS)
@BAD_INPUT_SETTINGS
def test_enable_refuses_a_loss_scale_option_value_by_its_name(value):
    refused_without_change(
        lambda: tfmp.enable("float32", loss_scale_options={"initial_scale": value}), "initial_scale")


@covers("enable")
@given(debug=st.one_of(st.integers(), st.floats(), st.text(max_size=4), st.lists(st.booleans(), max_size=2),
                       st.builds(object)))
@BAD_INPUT_SETTINGS
def test_enable_refuses_debug_of_another_type(debug):
    refused_without_change(lambda: tfmp.enable("float32", debug=debug), "debug")


@covers("enable")
@given(key=st.sampled_from(["action", "phase", "layers", "trace_length"]), data=st.data())
@BAD_INPUT_SETTINGS
def test_enable_refuses_debug_values_by_their_key(key, data):
    wrong = {
        "action": st.one_of(st.text(max_size=6).filter(lambda s: s not in ("raise", "warn", "log")), NON_STRINGS),
        "phase": st.one_of(st.text(max_size=6).filter(lambda s: s not in ("forward", "backward", "both")),
                           NON_STRINGS),
        "layers": st.one_of(st.integers(), st.floats(), st.just([]), st.lists(st.integers(), min_size=1, max_size=2)),
        "trace_length": st.one_of(NEGATIVE_OR_ZERO_INTS, st.integers(min_value=1025), st.text(max_size=3),
                                  st.none(), st.floats()),
    }[key]
    value = data.draw(wrong)
    refused_without_change(lambda: tfmp.enable("float32", debug={key: value}), key)


@covers("enable", "recommend_policy")
@given(facts=NOT_MODELS.filter(lambda value: value is not None), policy=st.sampled_from(["auto", "float32"]))
@BAD_INPUT_SETTINGS
def test_enable_and_recommend_policy_refuse_device_facts(facts, policy):
    refused_without_change(lambda: tfmp.enable(policy, device_facts=facts), "device_facts")
    assert_refused(lambda: tfmp.recommend_policy(facts), "device_facts")


@covers("enable", "policy_scope")
@given(value=st.one_of(
    NON_BOOLS, st.none(),
    st.dictionaries(IDENTIFIERS.filter(lambda k: k not in speedups.FEATURES), st.booleans(), min_size=1, max_size=2),
    st.dictionaries(st.sampled_from(sorted(speedups.FEATURES)), NON_BOOLS, min_size=1, max_size=2)))
@BAD_INPUT_SETTINGS
def test_enable_refuses_speedups(value):
    refused_without_change(lambda: tfmp.enable("float32", speedups=value), "speedups")
    refused_without_change(lambda: in_scope(policy="float32", speedups=value), "speedups")


@covers("recommend_policy")
@given(probe=NOT_MODELS.filter(lambda value: value is not None))
@BAD_INPUT_SETTINGS
def test_recommend_policy_refuses_a_speed_probe(probe):
    assert_refused(lambda: tfmp.recommend_policy(speed_probe=probe), "speed_probe")


@covers("recommend_policy")
def test_recommend_policy_decides_given_facts():
    v100 = tfmp.DeviceFacts(gpus=(tfmp.GpuFacts("Tesla V100", (7, 0)),))
    assert tfmp.recommend_policy(v100).policy == "mixed_float16"


@covers("policy_scope")
@given(option=IDENTIFIERS.filter(lambda k: k not in (
    "keep_float32", "exclude_float32", "loss_scale_options", "allow_pure_16bit", "tf32", "debug", "device_facts",
    "speedups", "verbose")),
    value=st.integers())
@BAD_INPUT_SETTINGS
def test_policy_scope_refuses_an_unknown_option_as_enable_does(option, value):
    """Python's own TypeError for an unknown keyword, the same from both, naming the option."""
    for call in (lambda: tfmp.enable("float32", **{option: value}),
                 lambda: in_scope(policy="float32", **{option: value})):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{option}'"):
            call()
        assert not enable_module.is_enabled()


@covers("enable", "disable", "policy_scope")
def test_empty_targets_are_accepted_and_disable_restores():
    before = keras.config.dtype_policy().name
    with tfmp.policy_scope("float32", keep_float32=[], exclude_float32=()) as decision:
        assert decision.policy == "float32"
    assert not enable_module.is_enabled()
    assert tfmp.enable("float32", keep_float32=[]).policy == "float32"
    assert tfmp.disable() is None
    assert tfmp.disable() is None  # a second call, with nothing enabled, changes nothing
    assert keras.config.dtype_policy().name == before
    with pytest.raises(TypeError):  # Python's own signature check: disable() takes nothing
        tfmp.disable("float32")


@covers("PolicyDecision")
@given(policy=st.one_of(NOT_POLICY_NAMES, NON_STRINGS, st.just("auto")))
@BAD_INPUT_SETTINGS
def test_policy_decision_refuses_a_policy(policy):
    assert_refused(lambda: tfmp.PolicyDecision(policy, "reason", "device"), "policy")


@covers("PolicyDecision")
@given(value=NON_STRINGS, field=st.sampled_from(["reason", "device"]), tf32=NON_BOOLS)
@BAD_INPUT_SETTINGS
def test_policy_decision_refuses_fields(value, field, tf32):
    fields = {"policy": "mixed_float16", "reason": "r", "device": "d"}
    assert_refused(lambda: tfmp.PolicyDecision(**{**fields, field: value}), field)
    assert_refused(lambda: tfmp.PolicyDecision(**fields, tf32=tf32), "tf32")
    assert tfmp.PolicyDecision(**fields).compute_dtype == "float16"


# force_float32, register_float32, unregister_float32, float32_layers, Float32Rules, Registration

@covers("force_float32")
@given(targets=NOT_TARGETS, argument=st.sampled_from(["keep", "exclude"]))
@BAD_INPUT_SETTINGS
def test_force_float32_refuses_targets(model, targets, argument):
    assert_refused(lambda: tfmp.force_float32(model, **{argument: targets}), argument)


@covers("force_float32")
def test_force_float32_forces_an_unbuilt_model_when_it_is_built():
    keras.config.set_dtype_policy("mixed_float16")
    unbuilt = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)])
    assert tfmp.force_float32(unbuilt) is unbuilt
    unbuilt.build((None, 3))
    assert [layer.compute_dtype for layer in unbuilt.layers] == ["float16", "float32"]


@covers("register_float32", "unregister_float32", "Registration")
@given(target=NOT_TARGETS.filter(lambda value: value is not None))
@BAD_INPUT_SETTINGS
def test_register_and_unregister_refuse_targets(target):
    assert_refused(lambda: tfmp.register_float32(target), "targets")
    assert_refused(lambda: tfmp.unregister_float32(target), "targets")
    assert_refused(lambda: tfmp.Registration([target], False), "added")
    assert tfmp.float32_layers().keep == () and tfmp.float32_layers().exclude == ()


@covers("register_float32", "unregister_float32", "float32_layers")
@given(exclude=NON_BOOLS)
@BAD_INPUT_SETTINGS
def test_register_refuses_exclude_and_an_empty_call(exclude):
    assert_refused(lambda: tfmp.register_float32("head/*", exclude=exclude), "exclude")
    assert_refused(lambda: tfmp.register_float32(), "targets")
    assert_refused(lambda: tfmp.unregister_float32(), "targets")
    assert_refused(lambda: tfmp.unregister_float32("never/registered"), "targets")
    with tfmp.register_float32("head/*", exclude=True) as registration:
        assert tfmp.float32_layers().exclude == ("head/*",)
        assert registration.added == ("head/*",)
    assert tfmp.float32_layers().exclude == ()
    assert keras.layers.Softmax in tfmp.float32_layers().builtin


@covers("Registration")
@given(added=st.one_of(st.none(), st.integers(), st.text(max_size=3), st.builds(object)), exclude=NON_BOOLS)
@BAD_INPUT_SETTINGS
def test_registration_refuses_fields(added, exclude):
    assert_refused(lambda: tfmp.Registration(added, False), "added")
    assert_refused(lambda: tfmp.Registration(["head/*"], exclude), "exclude")


@covers("Float32Rules")
@given(value=st.one_of(st.none(), st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2),
                       st.tuples(st.integers())),
       field=st.sampled_from(["builtin", "keep", "exclude", "known_broken", "float32_inside_keras"]))
@BAD_INPUT_SETTINGS
def test_float32_rules_refuses_fields(value, field):
    fields = {"builtin": (keras.layers.Softmax,), "keep": ("a*",), "exclude": ()}
    assert_refused(lambda: tfmp.Float32Rules(**{**fields, field: value}), field)
    assert tfmp.Float32Rules(**fields).keep == ("a*",)


# LossScaleOptimizer, scaled_gradients, the warnings

@covers("LossScaleOptimizer")
@given(inner=NOT_OPTIMIZERS)
@BAD_INPUT_SETTINGS
def test_loss_scale_optimizer_refuses_an_inner_optimizer(inner):
    assert_refused(lambda: tfmp.LossScaleOptimizer(inner), "inner_optimizer")


@covers("LossScaleOptimizer")
def test_loss_scale_optimizer_refuses_to_wrap_a_loss_scale_optimizer():
    wrapped = tfmp.LossScaleOptimizer(keras.optimizers.SGD())
    error = assert_refused(lambda: tfmp.LossScaleOptimizer(wrapped), "inner_optimizer")
    assert "opt.inner_optimizer" in str(error)
    keras_wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert_refused(lambda: tfmp.LossScaleOptimizer(keras_wrapped), "inner_optimizer")


@covers("LossScaleOptimizer")
@given(value=NOT_POSITIVE_NUMBERS, argument=st.sampled_from(["initial_scale", "min_scale", "max_scale"]))
@BAD_INPUT_SETTINGS
def test_loss_scale_optimizer_refuses_scales(value, argument):
    assert_refused(lambda: tfmp.LossScaleOptimizer(keras.optimizers.SGD(), **{argument: value}), argument)


@covers("LossScaleOptimizer")
@given(value=NOT_COUNTS,
       argument=st.sampled_from(["dynamic_growth_steps", "hysteresis", "max_consecutive_overflows"]))
@BAD_INPUT_SETTINGS
def test_loss_scale_optimizer_refuses_counts(value, argument):
    assert_refused(lambda: tfmp.LossScaleOptimizer(keras.optimizers.SGD(), **{argument: value}), argument)


@covers("LossScaleOptimizer")
@given(choice=st.one_of(st.text(max_size=6), NON_STRINGS), flag=NON_BOOLS,
       name=st.one_of(st.integers(), st.floats(), st.just(""), st.just("a/b"), st.builds(object)))
@BAD_INPUT_SETTINGS
def test_loss_scale_optimizer_refuses_choices_flags_and_names(choice, flag, name):
    inner = keras.optimizers.SGD()
    if choice not in ("raise", "warn"):
        assert_refused(lambda: tfmp.LossScaleOptimizer(inner, on_stuck=choice), "on_stuck")
    if choice not in ("auto", "batch", "loss", "gradients", "values"):
        assert_refused(lambda: tfmp.LossScaleOptimizer(inner, guard=choice), "guard")
    assert_refused(lambda: tfmp.LossScaleOptimizer(inner, loss_scaling=flag), "loss_scaling")
    assert_refused(lambda: tfmp.LossScaleOptimizer(inner, name=name), "name")


@covers("LossScaleOptimizer")
@given(key=IDENTIFIERS.filter(lambda k: k not in (
    "initial_scale", "dynamic_growth_steps", "min_scale", "max_scale", "hysteresis", "max_consecutive_overflows",
    "on_stuck", "loss_scaling", "guard", "name", "dynamic", "weight_decay", "clipnorm", "global_clipnorm",
    "clipvalue", "use_ema", "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
    "gradient_accumulation_steps")), value=st.integers())
@BAD_INPUT_SETTINGS
def test_loss_scale_optimizer_names_unknown_and_misplaced_keywords(key, value):
    inner = keras.optimizers.SGD()
    assert_refused(lambda: tfmp.LossScaleOptimizer(inner, **{key: value}), key)
    assert_refused(lambda: tfmp.LossScaleOptimizer(inner, dynamic=False), "dynamic")
    error = assert_refused(lambda: tfmp.LossScaleOptimizer(inner, clipnorm=1.0), "clipnorm")
    assert "on the `inner_optimizer`" in str(error)
    assert tfmp.LossScaleOptimizer(inner, dynamic=True, clipnorm=None, initial_scale=2.0**10).loss_scale == 1024.0


@covers("scaled_gradients")
@given(tape=NOT_MODELS)
@BAD_INPUT_SETTINGS
def test_scaled_gradients_refuses_a_tape(tape):
    variable = tf.Variable(1.0)
    assert_refused(lambda: tfmp.scaled_gradients(tape, tf.constant(1.0), [variable], keras.optimizers.SGD()),
                   "tape")


@covers("scaled_gradients")
@given(loss=st.one_of(NON_STRINGS, st.text(max_size=3), st.lists(st.floats(), min_size=2, max_size=3),
                      st.just("int tensor"), st.just("vector tensor")))
@BAD_INPUT_SETTINGS
def test_scaled_gradients_refuses_a_loss(loss):
    variable = tf.Variable(2.0)
    with tf.GradientTape() as tape:
        if loss == "int tensor":
            loss = tf.constant(3)
        elif loss == "vector tensor":
            loss = tf.stack([variable, variable])
    assert_refused(lambda: tfmp.scaled_gradients(tape, loss, [variable], keras.optimizers.SGD()), "loss")


@covers("scaled_gradients")
@given(variables=st.one_of(st.none(), st.integers(), st.text(max_size=3), st.just([]),
                           st.lists(st.one_of(st.integers(), st.text(max_size=2), st.none()), min_size=1, max_size=2)),
       optimizer=NOT_OPTIMIZERS)
@BAD_INPUT_SETTINGS
def test_scaled_gradients_refuses_variables_and_optimizer(variables, optimizer):
    variable = tf.Variable(2.0)
    with tf.GradientTape(persistent=True) as tape:
        loss = variable * 3.0
    assert_refused(lambda: tfmp.scaled_gradients(tape, loss, variables, keras.optimizers.SGD()), "variables")
    assert_refused(lambda: tfmp.scaled_gradients(tape, loss, [variable], optimizer), "optimizer")


@covers("scaled_gradients")
def test_scaled_gradients_multiplies_by_the_scale():
    variable = tf.Variable(2.0)
    for optimizer, expected in ((keras.optimizers.SGD(), 3.0),
                                (tfmp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=4.0), 12.0)):
        with tf.GradientTape() as tape:
            loss = variable * 3.0
        grads = tfmp.scaled_gradients(tape, loss, (variable,), optimizer)
        assert [float(g) for g in grads] == [expected]


@covers("LossScaleWarning", "SkippedStepWarning", "LoggingWarning", "PerformanceWarning", "UnmatchedTargetWarning")
@given(message=st.one_of(st.text(max_size=10), st.integers(), st.none(), st.floats(allow_nan=False)))
@BAD_INPUT_SETTINGS
def test_warnings_take_any_message_as_python_warnings_do(message):
    for kind, base in ((tfmp.LossScaleWarning, UserWarning), (tfmp.SkippedStepWarning, RuntimeWarning),
                       (tfmp.LoggingWarning, UserWarning), (tfmp.PerformanceWarning, UserWarning),
                       (tfmp.UnmatchedTargetWarning, UserWarning)):
        warning = kind(message)
        assert isinstance(warning, base)
        assert str(warning) == str(message)


# ChunkedSparseCategoricalCrossentropy, ChunkedCategoricalCrossentropy

CHUNKED_LOSSES = st.sampled_from([tfmp.ChunkedSparseCategoricalCrossentropy, tfmp.ChunkedCategoricalCrossentropy])


@covers("ChunkedSparseCategoricalCrossentropy", "ChunkedCategoricalCrossentropy")
@given(loss=CHUNKED_LOSSES, from_logits=st.one_of(st.just(False), NON_BOOLS, st.none()),
       smoothing=st.one_of(NON_NUMBERS, NON_FINITE, st.floats(max_value=-1e-9), st.floats(min_value=1.0 + 1e-9)),
       chunk_bytes=st.one_of(NOT_COUNTS.filter(lambda value: value is not None), st.integers(min_value=2**30 + 1)),
       fuse=st.one_of(NON_BOOLS, st.none()))
@BAD_INPUT_SETTINGS
def test_chunked_losses_refuse_logits_flags_smoothing_and_chunk_sizes(loss, from_logits, smoothing, chunk_bytes,
                                                                      fuse):
    assert_refused(lambda: loss(from_logits=from_logits), "from_logits")
    assert_refused(lambda: loss(label_smoothing=smoothing), "label_smoothing")
    assert_refused(lambda: loss(chunk_bytes=chunk_bytes), "chunk_bytes")  # None: the default sizes
    assert_refused(lambda: loss(fuse_projection=fuse), "fuse_projection")


@covers("ChunkedSparseCategoricalCrossentropy")
@given(ignore_class=st.one_of(st.booleans(), st.floats(), st.text(max_size=3), st.lists(st.integers(), max_size=2)))
@BAD_INPUT_SETTINGS
def test_chunked_sparse_loss_refuses_an_ignore_class(ignore_class):
    assert_refused(lambda: tfmp.ChunkedSparseCategoricalCrossentropy(ignore_class=ignore_class), "ignore_class")


# LossScaleMonitor

@covers("LossScaleMonitor")
@given(log_dir=st.one_of(NON_STRINGS, st.just("")))
@BAD_INPUT_SETTINGS
def test_monitor_refuses_a_log_dir(log_dir):
    assert_refused(lambda: tfmp.LossScaleMonitor(log_dir), "log_dir")


@covers("LossScaleMonitor")
def test_monitor_refuses_a_log_dir_under_a_file(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert_refused(lambda: tfmp.LossScaleMonitor(str(a_file)), "log_dir")
    assert_refused(lambda: tfmp.LossScaleMonitor(a_file / "run"), "log_dir")


@covers("LossScaleMonitor")
@given(freq=st.one_of(NEGATIVE_OR_ZERO_INTS, st.floats(), st.text(max_size=5).filter(
    lambda s: s not in ("epoch", "batch")), st.none(), st.booleans(), st.builds(object)),
    stats=st.one_of(NEGATIVE_OR_ZERO_INTS, st.floats(), st.text(max_size=3), st.booleans()))
@BAD_INPUT_SETTINGS
def test_monitor_refuses_frequencies(tmp_path, freq, stats):
    assert_refused(lambda: tfmp.LossScaleMonitor(str(tmp_path), update_freq=freq), "update_freq")
    assert_refused(lambda: tfmp.LossScaleMonitor(str(tmp_path), grad_stats_freq=stats), "grad_stats_freq")


# check_numerics, NumericsHandle, NonFiniteError

@covers("force_float32", "check_numerics", "NumericsHandle", "audit")
@given(value=st.one_of(NOT_MODELS, st.builds(keras.Sequential)))  # an empty Sequential: no layer
@BAD_INPUT_SETTINGS
def test_model_functions_refuse_a_model_without_layers_or_no_model(value):
    assert_refused(lambda: tfmp.force_float32(value), "model")
    assert_refused(lambda: tfmp.check_numerics(value), "model")
    assert_refused(lambda: tfmp.NumericsHandle(value, "raise", "both", None, 8), "model")
    assert_refused(lambda: tfmp.audit(value), "model")


def test_compiling_an_empty_sequential_under_enable_works_as_in_plain_keras():
    """Only the explicit calls refuse a model without layers; compile() stays Keras's."""
    with tfmp.policy_scope("mixed_bfloat16"):
        model = keras.Sequential()
        model.compile("sgd", "mse")  # plain Keras compiles it too
        model.add(keras.Input((3,)))
        model.add(keras.layers.Dense(2))
    assert model.layers[0].compute_dtype == "bfloat16"
    assert model.compiled


@covers("check_numerics", "NumericsHandle")
@given(action=st.one_of(st.text(max_size=6).filter(lambda s: s not in ("raise", "warn", "log")), NON_STRINGS),
       phase=st.one_of(st.text(max_size=6).filter(lambda s: s not in ("forward", "backward", "both")), NON_STRINGS),
       trace_length=st.one_of(NEGATIVE_OR_ZERO_INTS, st.integers(min_value=1025), st.floats(), st.text(max_size=2)),
       enabled=NON_BOOLS)
@BAD_INPUT_SETTINGS
def test_check_numerics_refuses_options(model, action, phase, trace_length, enabled):
    assert_refused(lambda: tfmp.check_numerics(model, action=action), "action")
    assert_refused(lambda: tfmp.check_numerics(model, phase=phase), "phase")
    assert_refused(lambda: tfmp.check_numerics(model, trace_length=trace_length), "trace_length")
    assert_refused(lambda: tfmp.check_numerics(model, enabled=enabled), "enabled")
    assert_refused(lambda: tfmp.NumericsHandle(model, action, "both", None, 8), "action")


@covers("check_numerics")
@given(layers=st.one_of(st.integers(), st.floats(), st.just([]), st.just(""), st.just("no_such_layer"),
                        st.lists(st.one_of(st.integers(), st.none()), min_size=1, max_size=2)))
@BAD_INPUT_SETTINGS
def test_check_numerics_refuses_layers(model, layers):
    assert_refused(lambda: tfmp.check_numerics(model, layers=layers), "layers")


@covers("check_numerics", "NumericsHandle")
def test_check_numerics_takes_an_unbuilt_model():
    unbuilt = keras.Sequential([keras.layers.Dense(4, name="first"), keras.layers.Dense(2, name="second")])
    with tfmp.check_numerics(unbuilt, layers=["second"]) as handle:
        assert isinstance(handle, tfmp.NumericsHandle)
        assert [layer.name for layer in handle.layers] == ["second"]
    assert not handle.active


@covers("NonFiniteError")
@given(text=NON_STRINGS, step=st.one_of(st.text(max_size=3), st.floats(), st.builds(object)),
       details=NOT_DICTS, field=st.sampled_from(["layer", "phase", "kind"]))
@BAD_INPUT_SETTINGS
def test_non_finite_error_refuses_fields(text, step, details, field):
    if text is not None:
        assert_refused(lambda: tfmp.NonFiniteError("m", **{field: text}), field)
    assert_refused(lambda: tfmp.NonFiniteError("m", step=step), "step")
    assert_refused(lambda: tfmp.NonFiniteError("m", details=details), "details")
    error = tfmp.NonFiniteError(5, step=3, details=None)  # any message, as for any exception
    assert (str(error), error.step, error.details) == ("5", 3, {})


# audit, AuditReport

@covers("audit")
@given(batch_size=st.one_of(NEGATIVE_OR_ZERO_INTS, st.floats(), st.text(max_size=3), st.booleans()),
       tensor_cores=NON_BOOLS)
@BAD_INPUT_SETTINGS
def test_audit_refuses_batch_size_and_tensor_cores(model, batch_size, tensor_cores):
    assert_refused(lambda: tfmp.audit(model, batch_size=batch_size), "batch_size")
    assert_refused(lambda: tfmp.audit(model, tensor_cores=tensor_cores), "tensor_cores")


@covers("audit")
@given(batch=st.one_of(st.text(max_size=3), st.integers(), st.builds(object),
                       st.sampled_from([(2, 5), (2, 3, 1), (0, 3), (3,)]).map(np.zeros)))
@BAD_INPUT_SETTINGS
def test_audit_refuses_a_batch(model, batch):
    assert_refused(lambda: tfmp.audit(model, batch=batch), "batch")
    assert_refused(lambda: tfmp.audit(model, batch=(batch, np.zeros((2, 4)))), "batch")


@covers("audit")
def test_audit_reports_a_model_and_a_batch(model):
    report = tfmp.audit(model, batch=(np.zeros((2, 3), "float32"), np.zeros((2, 4), "float32")), batch_size=8,
                        tensor_cores=False)
    assert [(row.path, row.compute_dtype, row.params) for row in report.rows] == [("out", "float32", 16)]
    assert [(row.variable_dtype, row.gradient_dtype) for row in report.gradients] == [("float32", "float32")] * 2


@covers("AuditReport")
@given(value=st.one_of(st.none(), st.integers(), st.text(max_size=3), st.tuples(st.integers())),
       field=st.sampled_from(["rows", "warnings", "gradients"]),
       fraction=st.one_of(NON_NUMBERS, NON_FINITE, st.floats(min_value=1.01), st.floats(max_value=-0.01)))
@BAD_INPUT_SETTINGS
def test_audit_report_refuses_fields(value, field, fraction):
    fields = {"policy": "float32", "rows": (), "warnings": (), "float32_fraction": 0.0}
    if not isinstance(value, str):
        assert_refused(lambda: tfmp.AuditReport(**{**fields, "policy": value}), "policy")
    assert_refused(lambda: tfmp.AuditReport(**{**fields, field: value}), field)
    assert_refused(lambda: tfmp.AuditReport(**{**fields, "float32_fraction": fraction}), "float32_fraction")
    assert_refused(lambda: tfmp.AuditReport(**fields, policy_source="global"), "policy_source")
    assert tfmp.AuditReport(**fields).kinds == frozenset()


# attachment, detach, Attachment

@covers("attachment", "detach")
@given(value=NOT_MODELS)
@BAD_INPUT_SETTINGS
def test_attachment_and_detach_refuse_a_model(value):
    assert_refused(lambda: tfmp.attachment(value), "model")
    assert_refused(lambda: tfmp.detach(value), "model")


@covers("step_scope")
@given(value=NOT_MODELS)
@BAD_INPUT_SETTINGS
def test_step_scope_refuses_what_is_not_a_model(value):
    assert_refused(lambda: tfmp.step_scope(value), "model")


@covers("attachment", "detach")
def test_a_model_never_attached_has_no_attachment(model):
    assert tfmp.attachment(model) is None
    assert tfmp.attachment(model.layers[0]) is None
    assert tfmp.detach(model) is None


@covers("Attachment")
@given(text=NON_STRINGS, flag=NON_BOOLS, count=st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=2)),
       mapping=st.one_of(NOT_DICTS, st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2)))
@BAD_INPUT_SETTINGS
def test_attachment_record_refuses_fields(text, flag, count, mapping):
    fields = {"model": "m", "attached_by": "compile", "policy": "mixed_float16"}
    assert_refused(lambda: tfmp.Attachment(**{**fields, "policy": text}), "policy")
    assert_refused(lambda: tfmp.Attachment(**fields, check_numerics=flag), "check_numerics")
    assert_refused(lambda: tfmp.Attachment(**fields, exact_ids=count), "exact_ids")
    assert_refused(lambda: tfmp.Attachment(**fields, layer_policies=mapping), "layer_policies")
    assert tfmp.Attachment(**fields).remapper == "on"


# multi_worker_strategy (refused before any TensorFlow runtime or server starts)

@covers("multi_worker_strategy")
@given(timeout=st.one_of(NON_NUMBERS, NON_FINITE, st.floats(max_value=0.0, allow_nan=False), st.booleans()),
       options=st.one_of(st.integers(), st.text(max_size=3), st.dictionaries(st.text(max_size=2), st.integers())))
@BAD_INPUT_SETTINGS
def test_multi_worker_strategy_refuses_its_arguments(timeout, options):
    assert_refused(lambda: tfmp.multi_worker_strategy(timeout), "timeout_s")
    assert_refused(lambda: tfmp.multi_worker_strategy(60.0, communication_options=options),
                   "communication_options")

def test_this_module_covers_its_half_of_the_public_names():
    import sys

    from _bad_input import covered_names

    half = {
        "enable", "disable", "policy_scope", "recommend_policy", "force_float32", "register_float32",
        "unregister_float32", "float32_layers", "Float32Rules", "Registration", "LossScaleOptimizer",
        "LossScaleWarning", "SkippedStepWarning", "scaled_gradients", "LossScaleMonitor", "LoggingWarning",
        "check_numerics", "NumericsHandle", "NonFiniteError", "audit", "AuditReport", "attachment", "detach", "step_scope",
        "Attachment", "multi_worker_strategy", "PerformanceWarning", "PolicyDecision", "UnmatchedTargetWarning",
        "ChunkedSparseCategoricalCrossentropy", "ChunkedCategoricalCrossentropy",
    }
    assert covered_names([sys.modules[__name__]]) == half
    assert half <= set(tfmp.__all__)


def test_a_bad_loss_scale_option_raises_before_the_policy_warns():
    """mixed_float16 on a CPU warns that it is slow; an option typo must not be preceded by that warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="init_scale"):
            tfmp.enable("mixed_float16", loss_scale_options={"init_scale": 8}, device_facts=ZEN4)
    assert [w for w in caught if issubclass(w.category, tfmp.PerformanceWarning)] == []
    assert not enable_module.is_enabled()
