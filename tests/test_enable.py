"""tfmp.enable / disable / policy_scope: global policy, compile hook, restoration."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _collect import collect_everything

import tfmp
from tfmp import DeviceFacts, GpuFacts
from tfmp._src.errors import guide
from tfmp._src.policy import enable

V100 = DeviceFacts(gpus=(GpuFacts("Tesla V100", (7, 0)),))
A100 = DeviceFacts(gpus=(GpuFacts("NVIDIA A100", (8, 0)),))
ORIGINAL_COMPILE = keras.Model.compile


@pytest.fixture(autouse=True)
def always_disable():
    yield
    tfmp.disable()
    assert keras.Model.compile is ORIGINAL_COMPILE


def mlp(with_sensitive_layers=False):
    inputs = keras.Input((784,))
    x = keras.layers.Dense(512, activation="relu")(inputs)
    if with_sensitive_layers:
        x = keras.layers.LayerNormalization()(x)
        x = keras.layers.Softmax()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def test_enable_sets_policy_and_disable_restores():
    keras.config.set_dtype_policy("float32")
    decision = tfmp.enable("mixed_bfloat16", device_facts=A100)
    assert decision.policy == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    tfmp.disable()
    assert keras.config.dtype_policy().name == "float32"


def test_enable_auto_uses_device_facts():
    assert tfmp.enable(device_facts=V100).policy == "mixed_float16"
    assert keras.config.dtype_policy().name == "mixed_float16"


def test_enable_twice_is_idempotent_and_disable_restores_first_policy():
    keras.config.set_dtype_policy("float32")
    first = tfmp.enable("mixed_bfloat16", device_facts=A100)
    hooked = keras.Model.compile
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same policy again: nothing to say
        assert tfmp.enable("mixed_bfloat16", device_facts=A100) == first
    assert keras.Model.compile is hooked  # not wrapped twice
    with pytest.warns(UserWarning, match="replaces the policy 'mixed_bfloat16'"):
        tfmp.enable("mixed_float16", device_facts=V100)
    assert keras.config.dtype_policy().name == "mixed_float16"
    tfmp.disable()
    assert keras.config.dtype_policy().name == "float32"
    assert keras.Model.compile is ORIGINAL_COMPILE


def test_enable_with_another_policy_warns_naming_both_and_the_explicit_way():
    keras.config.set_dtype_policy("float32")
    tfmp.enable("mixed_bfloat16", device_facts=A100)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tfmp.enable("mixed_float16", device_facts=V100)
    assert [(w.category, str(w.message), w.filename) for w in record] == [(
        UserWarning,
        "tfmp.enable('mixed_float16') replaces the policy 'mixed_bfloat16' of the earlier tfmp.enable() "
        "in this thread.\nModels compiled before keep 'mixed_bfloat16'; tfmp.disable() still restores "
        "'float32'.\nFix: call tfmp.disable() first, or for a block use `with "
        "tfmp.policy_scope('mixed_float16'):`.\nGuide: " + guide("policy-and-build-order"),
        __file__,
    )]
    tfmp.disable()
    assert keras.config.dtype_policy().name == "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the explicit ways say nothing
        tfmp.enable("mixed_float16", device_facts=V100)
        tfmp.disable()
        tfmp.enable("mixed_bfloat16", device_facts=A100)
        with tfmp.policy_scope("mixed_float16", device_facts=V100):
            assert keras.config.dtype_policy().name == "mixed_float16"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


def test_enable_inside_a_policy_scope_names_the_scope_it_replaces_until_the_scope_ends():
    keras.config.set_dtype_policy("float32")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with tfmp.policy_scope("mixed_float16", device_facts=V100):
            tfmp.enable("mixed_bfloat16", device_facts=A100)
            assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "float32" and not enable.is_enabled()
    [said] = [str(w.message) for w in record if w.category is UserWarning]
    assert said.startswith("tfmp.enable('mixed_bfloat16') replaces the policy 'mixed_float16' of the enclosing "
                           "tfmp.policy_scope() until it ends.\n")
    assert "earlier tfmp.enable()" not in said


def test_policy_scope_refuses_an_unknown_option_like_enable():
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_fp32'"):
        with tfmp.policy_scope("float32", keep_fp32=["head"]):
            pass
    assert not tfmp._src.policy.enable.is_enabled()


def test_disable_without_enable_does_nothing():
    keras.config.set_dtype_policy("mixed_bfloat16")
    tfmp.disable()
    tfmp.disable()
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


def test_policy_scope_restores_on_exception():
    keras.config.set_dtype_policy("float32")
    with pytest.raises(RuntimeError, match="boom"):
        with tfmp.policy_scope("mixed_bfloat16", device_facts=A100) as decision:
            assert decision.policy == "mixed_bfloat16"
            assert keras.config.dtype_policy().name == "mixed_bfloat16"
            raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == "float32"
    assert keras.Model.compile is ORIGINAL_COMPILE
    assert not tfmp._src.policy.enable.is_enabled()


def test_policy_scope_inside_enable_restores_outer_state():
    tfmp.enable("mixed_bfloat16", device_facts=A100, keep_float32=("*head*",))
    with tfmp.policy_scope("mixed_float16", device_facts=V100):
        assert keras.config.dtype_policy().name == "mixed_float16"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert tfmp._src.policy.enable.current_decision().policy == "mixed_bfloat16"
    assert tfmp._src.policy.session.current().keep_float32 == ("*head*",)


def test_policy_scope_with_bad_policy_restores():
    keras.config.set_dtype_policy("float32")
    with pytest.raises(ValueError, match="Did you mean 'mixed_float16'"):
        with tfmp.policy_scope("fp16"):
            pass
    assert keras.config.dtype_policy().name == "float32"
    assert keras.Model.compile is ORIGINAL_COMPILE


def test_bad_policy_leaves_state_untouched():
    keras.config.set_dtype_policy("float32")
    with pytest.raises(ValueError):
        tfmp.enable("float16")
    assert keras.config.dtype_policy().name == "float32"
    assert keras.Model.compile is ORIGINAL_COMPILE


def test_bad_tf32_option():
    with pytest.raises(ValueError, match=r"Invalid `tf32` argument.*Received: tf32='yes'"):
        tfmp.enable("float32", tf32="yes")


def test_tf32_switch_is_restored():
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    tfmp.enable("float32", tf32=not before)
    assert tf.config.experimental.tensor_float_32_execution_enabled() is (not before)
    tfmp.disable()
    assert tf.config.experimental.tensor_float_32_execution_enabled() is before


def test_explicit_slow_policy_warns(recwarn):
    cpu = DeviceFacts(cpu_name="AMD EPYC", cpu_flags=frozenset({"avx512_bf16"}))
    warnings.simplefilter("always")
    tfmp.enable("mixed_float16", device_facts=cpu)
    perf = [w for w in recwarn if issubclass(w.category, tfmp.PerformanceWarning)]
    assert len(perf) == 1
    assert "mixed_bfloat16" in str(perf[0].message)


def test_compile_hook_mixed_float16():
    """The foundation issue's acceptance case."""
    tfmp.enable("mixed_float16", device_facts=V100)
    model = mlp(with_sensitive_layers=True)
    model.compile(optimizer="adam", loss=keras.losses.MeanSquaredError())
    assert all(out.dtype == "float32" for out in model.outputs)
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.Adam)
    norm, softmax = model.layers[2], model.layers[3]
    assert softmax.compute_dtype == "float32" and softmax.output.dtype == "float16"  # handed back
    assert norm.compute_dtype == "float16"  # Keras computes LayerNormalization in float32 itself
    assert model.layers[1].compute_dtype == "float16"  # the hidden Dense stays fast
    x = np.random.default_rng(0).random((32, 784), dtype="float32")
    y = np.zeros((32, 10), dtype="float32")
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert model.predict(x[:4], verbose=0).dtype == np.float32
    # 2 steps (32 samples, batch 16); softmax outputs keep the scaled gradients
    # far below 65504 at the initial scale 2**15, so neither step is skipped.
    optimizer = model.optimizer
    assert int(optimizer.overflow_count.numpy()) == 0
    assert (int(optimizer.total_steps.numpy()), int(optimizer.iterations.numpy())) == (2, 2)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**15
    assert "overflow_count" in [v.path.split("/")[-1] for v in model.optimizer.variables]


def test_compile_hook_keyword_optimizer_and_bf16():
    tfmp.enable("mixed_bfloat16", device_facts=A100)
    model = mlp()
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
    assert isinstance(model.optimizer, tfmp.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.SGD)
    assert model.outputs[0].dtype == "float32"
    x = np.ones((8, 784), "float32")
    model.fit(x, np.zeros((8, 10), "float32"), epochs=1, verbose=0)
    assert float(model.optimizer.dynamic_scale.numpy()) == 1.0  # no scaling for bf16


def test_after_disable_compile_is_plain_keras():
    tfmp.enable("mixed_float16", device_facts=V100)
    tfmp.disable()
    keras.config.set_dtype_policy("mixed_float16")
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    assert model.outputs[0].dtype == "float16"


def test_debug_option_instruments_compiled_models():
    tfmp.enable("mixed_bfloat16", device_facts=A100, debug=True)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8)(inputs)
    blown = keras.layers.Lambda(lambda t: t / 0.0, name="divide_by_zero")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1)(blown))
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 4), "float32")
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(x, np.zeros((8, 1), "float32"), epochs=1, verbose=0)
    assert info.value.phase == "forward"
    assert "divide_by_zero" in info.value.layer
    assert info.value.step == 0


def test_bad_debug_option():
    with pytest.raises(ValueError, match=r"Invalid `debug` argument.*Received: debug='on'"):
        tfmp.enable("float32", debug="on")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loss_scale_options": 5}, r"Invalid `loss_scale_options` argument.*Received: loss_scale_options=5"),
        ({"loss_scale_options": {"initial_scael": 2.0}}, r"Did you mean 'initial_scale'"),
        ({"loss_scale_options": {"min_scale": -1.0}}, r"Invalid `min_scale` argument"),
        ({"debug": {"acton": "warn"}}, r"Invalid `debug` argument.*Did you mean 'action'"),
        ({"keep_float32": [3]}, r"Invalid `keep_float32` argument.*Received: keep_float32=3"),
        ({"exclude_float32": [keras.layers.Dense(2)]}, r"Invalid `exclude_float32` argument"),
        ({"keep_float32": keras.layers.Dense(2)}, r"Invalid `keep_float32` argument.*not an instance"),
        ({"keep_float32": 5}, r"Received: keep_float32=5 \(of type int\)"),
        ({"exclude_float32": {"dense": 1}}, r"Invalid `exclude_float32` argument"),
        ({"allow_pure_16bit": "no"}, r"Expected True or False. Received: allow_pure_16bit='no'"),
    ],
)
def test_bad_options_leave_everything_untouched(options, message):
    keras.config.set_dtype_policy("float32")
    with pytest.raises(ValueError, match=message):
        tfmp.enable("mixed_bfloat16", device_facts=A100, **options)
    assert not tfmp._src.policy.enable.is_enabled()
    assert keras.config.dtype_policy().name == "float32"
    assert keras.Model.compile is ORIGINAL_COMPILE


def test_a_core_hook_that_fails_to_install_leaves_tfmp_and_keras_as_they_were(monkeypatch):
    """The float32 loss terms are core (not an optional feature that switches itself off)."""
    from tfmp._src.keras_hooks.patches import defining_class
    from tfmp._src.attachment import hooks as attachment_hooks
    from tfmp._src.keras_hooks import patches
    from tfmp._src.policy import enable as enable_module

    trainer = defining_class(keras.Model, "compile")
    compile_before = vars(trainer)["compile"]

    def fail():
        raise RuntimeError("the loss-terms hook fails")

    monkeypatch.setattr(attachment_hooks, "install_losses_hook", fail)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="the loss-terms hook fails"):
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        tfmp.enable("mixed_bfloat16")
    assert not enable_module.is_enabled() and enable_module._session_hooks == []
    assert vars(trainer)["compile"] is compile_before  # the session hooks came off
    assert attachment_hooks.installed() == [] and patches.installed(keras.layers.Layer) == []
    assert keras.config.dtype_policy().name == "float32"


def test_single_keep_pattern_is_not_split_into_letters():
    tfmp.enable("mixed_bfloat16", device_facts=A100, keep_float32="hidden",
                exclude_float32=keras.layers.Softmax)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    outputs = keras.layers.Dense(2)(keras.layers.Softmax()(hidden))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    assert model.get_layer("hidden").compute_dtype == "float32"
    assert model.layers[2].compute_dtype == "bfloat16"  # the excluded Softmax


def test_compiling_a_model_built_before_enable_warns():
    keras.config.set_dtype_policy("float32")
    model = mlp()
    tfmp.enable("mixed_bfloat16", device_facts=A100)
    with pytest.warns(tfmp.PerformanceWarning, match="(?s)built under 'float32'.*after tfmp.enable"):
        model.compile(optimizer="sgd", loss="mse")


def test_enable_with_loss_scale_options_alone_leaves_keras_unhooked_after_disable():
    """The optimizers enable() checks the options with are never built: no fit hook from them."""
    from tfmp._src.keras_hooks import patches
    from tfmp._src.keras_hooks.patches import defining_class

    collect_everything()
    tfmp.disable()  # not enabled: takes off the hooks of optimizers other tests left to the collector
    trainer = defining_class(keras.Model, "make_train_function")
    assert patches.installed(trainer, "make_train_function") == []
    tfmp.enable("float32", loss_scale_options={"initial_scale": 2.0**10, "max_consecutive_overflows": 5})
    tfmp.disable()
    assert patches.installed(trainer, "make_train_function") == []


@pytest.mark.parametrize("entry", ["enable", "policy_scope"])
def test_the_slower_than_float32_warning_names_the_callers_line(entry):
    from _machines import ZEN4

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if entry == "enable":
            tfmp.enable("mixed_float16", device_facts=ZEN4)
        else:
            with tfmp.policy_scope("mixed_float16", device_facts=ZEN4):
                pass
    slow = [w for w in caught if issubclass(w.category, tfmp.PerformanceWarning)]
    assert [w.filename for w in slow] == [__file__] and "slower than float32" in str(slow[0].message)


def _dense_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


@pytest.mark.parametrize("when", ["built_before_enable", "global_policy_changed_after_enable"])
def test_a_model_under_another_policy_is_said_at_compile_with_its_cause(when):
    try:
        if when == "built_before_enable":
            model = _dense_model()
            tfmp.enable("mixed_bfloat16")
        else:
            tfmp.enable("mixed_bfloat16")
            keras.mixed_precision.set_global_policy("float32")
            model = _dense_model()
        with pytest.warns(tfmp.PerformanceWarning) as record:
            model.compile("sgd", "mse")
    finally:
        tfmp.disable()
        keras.config.set_dtype_policy("float32")
    [message] = [str(w.message) for w in record if "was built under" in str(w.message)]
    assert "Model 'sequential" in message and "'float32', not tfmp's 'mixed_bfloat16'" in message
    message = message.rsplit("\nGuide: ", 1)[0]
    if when == "built_before_enable":
        assert message.endswith("build the model after tfmp.enable().")
    else:
        assert "The global policy was changed to 'float32' after tfmp.enable()" in message
        assert message.endswith("or call tfmp.enable('float32') instead.")


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="the XLA failure is the CPU compiler's")
def test_compile_hook_turns_xla_off_for_a_16_bit_bilinear_upsampling_on_one_replica():
    """The compile hook asks the bilinear rule when the replica rule turned nothing off (one
    replica): a bfloat16 bilinear UpSampling2D compiled with jit_compile=True gets
    jit_compile=False, with its warning (openxla/xla#43052; test_public_bug_kinds_errors.py
    trains such a model)."""
    tfmp.enable("mixed_bfloat16", device_facts=A100)
    model = keras.Sequential([keras.Input((4, 4, 2)), keras.layers.Conv2D(2, 1, activation="tanh"),
                              keras.layers.UpSampling2D(interpolation="bilinear", name="up"),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    with pytest.warns(tfmp.PerformanceWarning, match=r"with jit_compile=False: XLA cannot train its bfloat16 bilinear resizes"):
        model.compile("sgd", "mse", jit_compile=True)
    assert model.jit_compile is False


@pytest.mark.parametrize("guard", ["batch", "loss"])
def test_a_loss_only_guard_passes_the_options_check_without_loss_scaling_only(guard):
    """`loss_scale_options` are checked as for float16 with a loss-only guard left out, then for
    the policy's compute dtype: ``guard="batch"`` or ``"loss"`` is accepted under bfloat16
    (no loss scaling) and refused under float16 (test_safety.py and test_loss_scale_guard.py
    train with them)."""
    tfmp.enable("mixed_bfloat16", device_facts=A100, loss_scale_options={"guard": guard})
    tfmp.disable()
    with pytest.raises(ValueError, match="Invalid `guard` argument"):
        tfmp.enable("mixed_float16", device_facts=V100, loss_scale_options={"guard": guard})


def test_a_loaded_model_compiled_again_without_tfmp_is_warned_about_at_fit(tmp_path):
    """A model Keras compiled while loading it under tfmp counts as tfmp's (no warning at fit)
    until it is compiled again: compiled in a thread without a session, it trains without
    tfmp, and fit under the session warns that it was compiled before tfmp.enable()."""
    import threading

    tfmp.enable("mixed_bfloat16", device_facts=A100)
    model = mlp()
    model.compile("sgd", "mse")
    x, y = np.ones((8, 784), "float32"), np.zeros((8, 10), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfmp.PerformanceWarning)
        loaded.fit(x, y, epochs=1, verbose=0)  # restored by Keras under tfmp: no warning
    thread = threading.Thread(target=lambda: loaded.compile("sgd", "mse"))  # no session there
    thread.start()
    thread.join()
    with pytest.warns(tfmp.PerformanceWarning, match="was compiled before tfmp.enable"):
        loaded.fit(x, y, epochs=1, verbose=0)
