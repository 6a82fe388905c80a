"""The one owner of hooks into Keras (tfmp/_src/keras_hooks): private names, patches, the step wrapper."""

import ast
import inspect
import json
import pathlib
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _collect import collect_everything

import tfmp
from tfmp._src.keras_hooks import (
    backend_ops,
    contracts,
    functional_graph,
    layer_calls,
    optimizer_steps,
    patches,
    projection_graph,
    runtime_options,
    train_function,
    trainer,
    versions,
)
from tfmp._src.monitor.grad_stats import GradientStats
from _subproc import ROOT, script_env

sys.path.insert(0, str(ROOT / "scripts"))
import keras_touch_points as touch_points  # noqa: E402

TFMP = pathlib.Path(tfmp.__file__).parent


# -- every private Keras name lives in its surface's module of keras_hooks ------


@pytest.mark.parametrize("owner, name", contracts.REQUIRED_ATTRIBUTES, ids=lambda x: getattr(x, "__name__", x))
def test_private_keras_attribute_exists(owner, name):
    assert hasattr(owner, name), (
        f"Keras {keras.__version__} has no {owner.__name__}.{name}: update "
        "the surface module of tfmp/_src/keras_hooks that lists it (checked on Keras "
        f"{versions.CHECKED_ON[0]})."
    )


def test_private_accessors_work_on_this_keras():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2, name="d")
    model = keras.Model(inputs, keras.ops.add(dense(inputs), 1.0))
    model.compile("adam", "mse")
    model.fit(np.ones((2, 3)), np.ones((2, 2)), verbose=0)
    assert layer_calls.child_layers(model)[-1] is dense
    assert functional_graph.functional_graph(model) is model
    assert functional_graph.is_functional(model) and not functional_graph.is_functional(keras.Sequential())
    history = functional_graph.keras_history(model.outputs[0])
    node = functional_graph.inbound_node(history.operation, history.node_index)
    assert functional_graph.keras_history(node.input_tensors[0]).operation is dense
    args, kwargs = functional_graph.first_call_arguments(dense)
    assert len(args) == 1 and args[0] is inputs and kwargs == {}
    assert functional_graph.first_call_arguments(keras.layers.Dense(2)) is None
    assert sum(len(nodes) for nodes in functional_graph.nodes_by_depth(model).values()) == 3
    assert layer_calls.autocasts_inputs(dense)
    assert int(trainer.loss_tracker(model).count.numpy()) == 2
    assert len(optimizer_steps.optimizer_variables(model.optimizer)) == 2
    assert not optimizer_steps.overwrites_with_gradient(model.optimizer, dense.kernel)
    adam = keras.optimizers.Adam()
    adam.build([dense.kernel, dense.bias])
    momentum, velocity = optimizer_steps.adam_slots(adam, dense.bias)
    assert momentum.shape == velocity.shape == dense.bias.shape and momentum is not velocity
    assert "momentum" in momentum.path and "velocity" in velocity.path
    assert patches.defining_class(keras.Sequential, "compile").__name__ in trainer.BASE_TRAINER_NAMES
    assert patches.defining_class(keras.Sequential, "make_train_function").__name__ in (
        trainer.TENSORFLOW_TRAINER_NAMES)
    assert not runtime_options.in_xla_context()


def test_tensorflow_function_call_options_are_a_settable_per_thread_config():
    """`runtime_options.function_call_config` rests on these (tensorflow/python/eager/context.py)."""
    from tensorflow.python.eager import context

    fix = ("update runtime_options.function_call_config (checked on TensorFlow "
           f"{versions.CHECKED_ON[1]})")
    attribute = vars(type(context.context())).get("function_call_options")
    assert isinstance(attribute, property) and attribute.fset is not None, fix
    assert "function_call_options" in inspect.getsource(context.Context.call_function), fix
    options = context.FunctionCallOptions(executor_type="", config_proto=tf.compat.v1.ConfigProto())
    assert isinstance(options.config_proto_serialized, bytes), fix
    off = type(tf.compat.v1.ConfigProto().graph_options.rewrite_options).OFF

    def remapping_off(config):
        config.graph_options.rewrite_options.remapping = off

    before = context.context().function_call_options
    with runtime_options.function_call_config(remapping_off):
        assert runtime_options.function_call_config_now().graph_options.rewrite_options.remapping == off
    assert context.context().function_call_options is before


def _private_uses(path: pathlib.Path, names: set) -> set:
    return touch_points.private_uses(ast.parse(path.read_text()), names)


def test_no_module_outside_keras_hooks_touches_a_private_keras_name():
    names = touch_points.private_names()
    # The detector sees what the surface modules do (a check that can fail).
    hooks = TFMP / "_src" / "keras_hooks"
    assert "_flatten_layers" in _private_uses(hooks / "layer_calls.py", names)
    assert "_loss_tracker" in _private_uses(hooks / "trainer.py", names)
    assert "keras.src.utils.tracking.no_automatic_dependency_tracking" in _private_uses(
        hooks / "optimizer_steps.py", names)
    offenders = {}
    for path in TFMP.rglob("*.py"):
        if "keras_hooks" in path.parts:
            continue
        used = _private_uses(path, names)
        if used:
            offenders[str(path.relative_to(TFMP))] = sorted(used)
    assert offenders == {}


def _patching_uses(path: pathlib.Path) -> set:
    """What a module imports of `patches`, or any ``patches.<name>`` it reads."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfmp._src.keras_hooks"):
            found |= {f"import {alias.name}" for alias in node.names if alias.name == "patches"}
            if node.module.endswith(".patches"):
                found |= {f"import patches.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "patches":
            found.add(f"patches.{node.attr}")
    return found


def test_features_subscribe_through_surfaces_and_never_patch():
    hooks = TFMP / "_src" / "keras_hooks"
    assert "patches.Surface" in _patching_uses(hooks / "trainer.py")  # the detector sees a surface
    offenders = {}
    for path in TFMP.rglob("*.py"):
        if "keras_hooks" in path.parts:
            continue
        used = _patching_uses(path)
        if used:
            offenders[str(path.relative_to(TFMP))] = sorted(used)
    assert offenders == {}


def test_the_touch_point_count_sees_this_tree_and_a_feature_that_patches(tmp_path):
    names = touch_points.private_names()
    counted = touch_points.count(ROOT, names)
    assert counted["surfaces"] == 7 and counted["private_outside_keras_hooks"] == []
    assert counted["hook_sites_outside_keras_hooks"]["modules_importing_patches"] == 0
    assert "_flatten_layers" in counted["private_name_modules"]["tfmp/_src/keras_hooks/layer_calls.py"]
    feature = tmp_path / "tfmp" / "_src" / "float32" / "feature.py"  # a feature written the old way
    feature.parent.mkdir(parents=True)
    feature.write_text("import keras\nfrom tfmp._src.keras_hooks import patches\n_STORE = {}\n"
                       "def install(layer):\n    layer._tfmp_mark = layer._flatten_layers\n"
                       "    return patches.install(layer, 'call', lambda call: call, owner='numerics')\n")
    old = touch_points.count(tmp_path, names)
    assert old["private_outside_keras_hooks"] == ["_flatten_layers"] and old["hook_sites"] == 1
    assert old["hook_sites_outside_keras_hooks"] == {"modules": 1, "modules_importing_patches": 1}
    assert old["module_stores"] == {"stores": 1, "modules": 1} and old["hidden_attributes"] == ["_tfmp_mark"]


# -- patches: composition and exact teardown -----------------------------------


class _Thing:
    def greet(self, text):
        return f"hello {text}"


#: A surface of the tests' own (never registered with tfmp's): its subscribers, innermost first.
_GREETING = patches.Surface("greeting", methods=("greet",),
                            subscribers=("numerics", "grad_stats", "enable.compile", "train_function"))


def _tag(tag):
    def wrap(call):
        def tagged(*args, **kwargs):
            return f"{tag}({call(*args, **kwargs)})"

        return tagged

    return wrap


def test_hooks_compose_in_order_and_come_off_one_by_one():
    thing = _Thing()
    grad = _GREETING.subscribe(thing, "greet", _tag("grad"), owner="grad_stats")
    numerics = _GREETING.subscribe(thing, "greet", _tag("num"), owner="numerics")
    # Subscribed out of order, composed in the surface's order: numerics inside grad_stats.
    assert thing.greet("x") == "grad(num(hello x))"
    assert [h.owner for h in patches.installed(thing, "greet")] == ["numerics", "grad_stats"]
    grad.remove()
    assert thing.greet("x") == "num(hello x)"  # removing one keeps the other
    numerics.remove()
    assert thing.greet("x") == "hello x"
    assert "greet" not in vars(thing)  # exactly as before: no instance attribute left
    numerics.remove()  # idempotent
    assert patches.installed(thing) == []


def test_class_hook_restores_the_same_function_and_sits_below_instance_hooks():
    original = vars(_Thing)["greet"]
    thing = _Thing()
    on_instance = _GREETING.subscribe(thing, "greet", _tag("instance"), owner="train_function")
    on_class = _GREETING.subscribe(_Thing, "greet", _tag("class"), owner="enable.compile")
    # The instance hook looks the class attribute up at each call.
    assert thing.greet("x") == "instance(class(hello x))"
    assert _Thing().greet("y") == "class(hello y)"
    on_class.remove()
    assert vars(_Thing)["greet"] is original
    assert thing.greet("x") == "instance(hello x)"
    on_instance.remove()
    assert "greet" not in vars(thing)


def test_unknown_owner_and_class_without_the_method_are_refused():
    with pytest.raises(KeyError, match="Unknown hook owner"):
        _GREETING.subscribe(_Thing(), "greet", _tag("x"), owner="nobody")
    with pytest.raises(KeyError, match="not a method of the greeting surface"):
        _GREETING.subscribe(_Thing(), "wave", _tag("x"), owner="numerics")
    thing = _Thing()
    hook = _GREETING.subscribe(thing, "greet", _tag("x"), owner="numerics")
    other = patches.Surface("other", methods=("greet",), subscribers=("numerics",))
    with pytest.raises(RuntimeError, match="through the greeting surface, not the other one"):
        other.subscribe(thing, "greet", _tag("y"), owner="numerics")
    hook.remove()
    assert "greet" not in vars(thing)

    class Child(_Thing):
        pass

    with pytest.raises(AttributeError, match="defines it"):
        _GREETING.subscribe(Child, "greet", _tag("x"), owner="numerics")


def _failing_wrap(call):
    raise RuntimeError("this wrap factory fails")


def test_a_failing_wrap_changes_nothing():
    class Thing(_Thing):
        greet = _Thing.greet

    original, thing = vars(Thing)["greet"], Thing()
    good = _GREETING.subscribe(Thing, "greet", _tag("good"), owner="numerics")
    with pytest.raises(RuntimeError, match="this wrap factory fails"):
        _GREETING.subscribe(Thing, "greet", _failing_wrap, owner="grad_stats")
    assert thing.greet("x") == "good(hello x)"
    assert [h.owner for h in patches.installed(Thing, "greet")] == ["numerics"]
    good.remove()  # no ghost hook left to recompose
    assert vars(Thing)["greet"] is original and patches.installed(Thing) == []
    with pytest.raises(RuntimeError, match="this wrap factory fails"):
        _GREETING.subscribe(thing, "greet", _failing_wrap, owner="numerics")
    assert "greet" not in vars(thing) and patches.installed(thing) == []


def test_install_all_installs_every_hook_or_none():
    class Thing(_Thing):
        greet = _Thing.greet

    original = vars(Thing)["greet"]
    with pytest.raises(RuntimeError, match="this wrap factory fails"):
        patches.install_all([
            lambda: _GREETING.subscribe(Thing, "greet", _tag("first"), owner="numerics"),
            lambda: [_GREETING.subscribe(Thing, "greet", _failing_wrap, owner="grad_stats")],
        ])
    assert vars(Thing)["greet"] is original and patches.installed(Thing) == []

    def two_then_fail():  # an installer that installs some hooks, then raises
        _GREETING.subscribe(Thing, "greet", _tag("second"), owner="grad_stats")
        _GREETING.subscribe(Thing, "greet", _failing_wrap, owner="numerics")

    with pytest.raises(RuntimeError, match="this wrap factory fails"):
        patches.install_all([lambda: _GREETING.subscribe(Thing, "greet", _tag("first"), owner="train_function"),
                             two_then_fail])
    assert vars(Thing)["greet"] is original and patches.installed(Thing) == []
    hooks = patches.install_all([
        lambda: _GREETING.subscribe(Thing, "greet", _tag("a"), owner="numerics"),
        lambda: [_GREETING.subscribe(Thing, "greet", _tag("b"), owner="grad_stats")],
    ])
    assert [h.owner for h in hooks] == ["numerics", "grad_stats"] and Thing().greet("x") == "b(a(hello x))"
    for hook in hooks:
        hook.remove()
    assert vars(Thing)["greet"] is original


def test_a_patch_another_library_puts_on_top_is_never_overwritten():
    class Thing(_Thing):
        greet = _Thing.greet

    original = vars(Thing)["greet"]
    ours = _GREETING.subscribe(Thing, "greet", _tag("tfmp"), owner="numerics")
    below = vars(Thing)["greet"]

    def other(self, text):  # another library's patch, calling what it replaced
        return f"other({below(self, text)})"

    Thing.greet = other
    assert Thing().greet("x") == "other(tfmp(hello x))"
    with pytest.warns(RuntimeWarning, match=r"under another patch \(.*other\)"):
        ours.remove()
    assert vars(Thing)["greet"] is other  # kept, and tfmp's hook is gone from under it
    assert Thing().greet("x") == "other(hello x)"
    with pytest.warns(RuntimeWarning, match=r"Another patch \(.*other\) sits on .*Thing.greet above tfmp's"):
        again = _GREETING.subscribe(Thing, "greet", _tag("tfmp"), owner="numerics")
    assert Thing().greet("x") == "other(tfmp(hello x))"  # composed under the other patch
    with warnings.catch_warnings():  # made an error: nothing changes, the hook stays removable
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="Another patch"):
            _GREETING.subscribe(Thing, "greet", _tag("more"), owner="grad_stats")
        assert [h.owner for h in patches.installed(Thing, "greet")] == ["numerics"]
        with pytest.raises(RuntimeWarning, match="under another patch"):
            again.remove()
        assert again.active and Thing().greet("x") == "other(tfmp(hello x))"
    Thing.greet = below  # the other library takes its patch off
    again.remove()
    assert vars(Thing)["greet"] is original and patches.installed(Thing) == []


# -- the per-model step wrapper -------------------------------------------------


def _model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def test_train_function_checks_run_in_order_and_come_off_independently():
    model = _model()
    seen = []
    train_function.add_check(model, "stuck", lambda logs: seen.append("stuck") or logs)
    train_function.add_check(model, "numerics", lambda logs: seen.append("numerics") or logs)
    model.fit(np.ones((2, 2)), np.ones((2, 1)), verbose=0)
    assert seen == ["numerics", "stuck"]
    traced = model.train_function
    train_function.remove_check(model, "numerics")
    seen.clear()
    model.fit(np.ones((2, 2)), np.ones((2, 1)), verbose=0)
    assert seen == ["stuck"] and model.train_function is traced  # no retrace
    train_function.remove_check(model, "stuck")
    assert model.train_function is traced.tfmp_inner  # Keras's own function is back
    assert "make_train_function" not in vars(model)


def test_error_handlers_see_the_error_then_it_propagates():
    model = _model()
    errors = []
    train_function.add_error_handler(model, "a", errors.append)

    def failing(logs):
        raise RuntimeError("boom")

    train_function.add_check(model, "stuck", failing)
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(np.ones((2, 2)), np.ones((2, 1)), verbose=0)
    assert [str(e) for e in errors] == ["boom"]
    train_function.remove_check(model, "stuck")
    train_function.remove_error_handler(model, "a")


def test_monitor_and_check_numerics_leave_each_other_installed(tmp_path):
    """Issue 13 item 4: the monitor's teardown kept removing check_numerics' hook."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d")])
    model.compile(tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.1)), "mse")
    handle = tfmp.check_numerics(model, action="raise")
    monitor = tfmp.LossScaleMonitor(tmp_path, grad_stats_freq=1)
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, verbose=0, callbacks=[monitor])
    owners = [h.owner for h in patches.installed(model.optimizer, "apply")]
    assert owners == ["numerics", "grad_stats"]  # the monitor's end left numerics' hook
    bad = y.copy()
    bad[1] = np.nan
    with pytest.raises(tfmp.NonFiniteError) as info:  # backward checks still run
        model.fit(x, bad, verbose=0, batch_size=1)
    assert info.value.phase in ("loss", "backward")
    handle.remove()
    assert [h.owner for h in patches.installed(model.optimizer, "apply")] == ["grad_stats"]
    GradientStats.of(model.optimizer, 1, model.distribute_strategy).remove()
    assert "apply" not in vars(model.optimizer)


def test_stuck_check_is_attached_without_enable_and_comes_off_after_the_last_optimizer():
    from tfmp._src.loss_scale import loops

    collect_everything()
    before = len(loops._live)  # tfmp optimizers other tests may still hold
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(tfmp.LossScaleOptimizer(keras.optimizers.SGD(0.1)), "mse")
    model.fit(np.ones((2, 2)), np.ones((2, 1)), verbose=0)
    assert train_function.has_check(model, "stuck")
    trainer_class = patches.defining_class(keras.Model, "make_train_function")
    assert [h.owner for h in patches.installed(trainer_class, "make_train_function")] == ["loss_scale.fit_check"]
    assert len(loops._live) == before + 1
    del model
    keras.backend.clear_session()
    collect_everything()
    assert len(loops._live) == before
    # Not from the garbage collector: at the next make_train_function (or disable()).
    assert [h.owner for h in patches.installed(trainer_class, "make_train_function")] == ["loss_scale.fit_check"]
    _model().make_train_function()
    hooked = [h.owner for h in patches.installed(trainer_class, "make_train_function")]
    unserved = [optimizer for optimizer in loops._live if optimizer not in loops._served]  # other tests'
    assert hooked == (["loss_scale.fit_check"] if unserved else [])


def test_compile_hook_sits_where_keras_defines_compile():
    trainer_class = patches.defining_class(keras.Model, "compile")
    original = vars(trainer_class)["compile"]
    with tfmp.policy_scope("float32"):
        assert [h.owner for h in patches.installed(trainer_class, "compile")] == ["enable.compile"]
        assert keras.Sequential.compile is trainer_class.compile  # compile_from_config compiles
        assert "compile" not in vars(keras.Model)
    assert vars(trainer_class)["compile"] is original
    assert not trainer.compiled_by_tfmp(_model())


# -- supported versions ----------------------------------------------------------


@pytest.mark.parametrize(
    "keras_version, tf_version",
    [("3.12.0", "2.17.0"), ("3.15.1", "2.21.0"), ("3.16.0.dev2026", "2.22.0rc1")],
)
def test_supported_versions_import(keras_version, tf_version):
    versions.check_versions(keras_version, tf_version)


@pytest.mark.parametrize(
    "keras_version, tf_version",
    [("3.8.0", "2.19.1"), ("3.11.3", "2.20.0"), ("4.0.0", "2.21.0"), ("3.15.1", "2.16.1")],
)
def test_unsupported_versions_are_refused_naming_both(keras_version, tf_version):
    with pytest.raises(ImportError) as info:
        versions.check_versions(keras_version, tf_version)
    message = str(info.value)
    assert f"keras=={keras_version}, tensorflow=={tf_version}" in message
    assert "Keras >= 3.12.0, < 4.0.0 with TensorFlow >= 2.17.0" in message


def test_setup_cfg_ranges_are_the_tested_ones():
    import configparser

    config = configparser.ConfigParser()
    config.read(TFMP.parent / "setup.cfg")
    requires = config["options"]["install_requires"]
    dotted = lambda v: ".".join(map(str, v))  # noqa: E731
    above = lambda v: f"{v[0]}.{v[1] + 1}"  # noqa: E731  (the next minor)
    assert f"keras>={dotted(versions.MIN_KERAS)},<{above(versions.NEWEST_TESTED_KERAS)}" in requires
    assert (f"tensorflow>={dotted(versions.MIN_TENSORFLOW)},"
            f"<{above(versions.NEWEST_TESTED_TENSORFLOW)}") in requires
    ci = (TFMP.parent / ".ci" / "run").read_text()
    assert f'"keras=={dotted(versions.MIN_KERAS)}" "tensorflow=={dotted(versions.MIN_TENSORFLOW)}"' in ci
    # The newest minors are those of the pinned pre-release tier.
    assert f'"tf-nightly=={dotted(versions.NEWEST_TESTED_TENSORFLOW)}.0.dev' in ci
    assert f'"keras-nightly=={dotted(versions.NEWEST_TESTED_KERAS)}.0.dev' in ci


# -- giving Keras back ------------------------------------------------------------


def test_after_tfmp_lets_go_keras_is_as_without_tfmp():
    """Every method and property of Keras's main classes, before tfmp's import and after it lets go."""
    process = subprocess.run([sys.executable, str(ROOT / "tests" / "_keras_surface.py")], capture_output=True,
                             text=True, env=script_env(), cwd=ROOT, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    surfaces = json.loads(process.stdout.splitlines()[-1])
    plain, after = surfaces["plain"], surfaces["after"]
    assert len(plain) > 200 and any(name.endswith(f".{base}.compile") for name in plain
                                    for base in trainer.BASE_TRAINER_NAMES)
    changed = {name: (plain.get(name), after.get(name))
               for name in plain.keys() | after.keys() if plain.get(name) != after.get(name)}
    assert changed == {}


def test_the_leak_guard_sees_enabled_threads_and_class_hooks():
    from conftest import tfmp_leftovers

    assert tfmp_leftovers() == ([], [])
    with tfmp.policy_scope("float32"):
        threads, hooks = tfmp_leftovers()
        assert threads == ["tfmp enabled in MainThread"]
        assert {hook.owner for hook in hooks} == {
            "enable.compile", "enable.first_step", "enable.losses", "fused_batchnorm", "float32.from_config",
            "float32.exact", "enable.gradient_errors", "enable.build_errors", "gelu",
            "conv", "cross_entropy", "bias_gradient", "dropout", "enable.tflite_hint"}
    assert tfmp_leftovers() == ([], [])


# Contracts with TensorFlow's and Keras's error texts (keras_hooks/error_texts.py) -------

_BF16, _F32 = (lambda: tf.ones((2, 2), tf.bfloat16)), (lambda: tf.ones((2, 2)))
#: One call per `error_texts.DTYPE_MISMATCH` entry that makes TensorFlow raise that text.
_MISMATCH_PRODUCERS = {
    "graph op": lambda: tf.function(lambda a, b: a * b, autograph=False)(_BF16(), _F32()),
    "eager op": lambda: tf.raw_ops.Mul(x=_BF16(), y=_F32()),
    "conversion": lambda: tf.convert_to_tensor(_F32(), dtype=tf.bfloat16),
    "list op": lambda: tf.function(lambda a, b: tf.concat([a, b], 0), autograph=False)(_BF16(), _F32()),
    "division": lambda: _BF16() / _F32(),
}


def _raised(produce):
    try:
        produce()
    except (TypeError, ValueError, tf.errors.OpError) as error:  # what the contracts are about
        return error
    raise AssertionError("the producer raised nothing")


def _first_line(error):
    text = error.message if isinstance(error, tf.errors.OpError) else str(error)
    return text.strip().splitlines()[0]


def test_every_dtype_mismatch_text_has_a_contract_test():
    from tfmp._src.keras_hooks import error_texts

    assert set(_MISMATCH_PRODUCERS) == set(error_texts.DTYPE_MISMATCH)


@pytest.mark.parametrize("name", sorted(_MISMATCH_PRODUCERS))
def test_tensorflow_still_raises_each_dtype_mismatch_text(name):
    from tfmp._src.keras_hooks import error_texts

    error = _raised(_MISMATCH_PRODUCERS[name])
    cls, pattern = error_texts.DTYPE_MISMATCH[name]
    assert isinstance(error, cls)
    assert pattern.search(_first_line(error)), _first_line(error)
    assert error_texts.is_dtype_mismatch(error, _first_line(error))
    assert sorted(error_texts.mismatched_dtypes(_first_line(error))) == ["bfloat16", "float32"]


class _Fails(keras.layers.Layer):
    def call(self, x):
        raise ValueError("broken on purpose")


def test_keras_still_names_the_layer_that_raised():
    from tfmp._src.keras_hooks import error_texts

    layer = _Fails(name="fails")
    in_call = _raised(lambda: layer(tf.ones((1, 2))))  # eager call: Keras's traceback filter
    assert error_texts.layer_named_by_keras(str(in_call)) == (None, "_Fails")
    assert layer in list(error_texts.call_frame_owners(in_call))
    in_spec = _raised(lambda: _Fails(name="spec")(keras.Input((2,))))  # Functional construction
    assert error_texts.layer_named_by_keras(str(in_spec)) == ("spec", "_Fails")


def test_keras_still_replaces_a_lambdas_failed_shape_inference_keeping_the_mismatch_as_its_context():
    """`error_texts.LAMBDA_SHAPE`: read by tfmp's build-time explainer (`float32/build_errors.py`)."""
    from tfmp._src.keras_hooks import error_texts

    shift = keras.layers.Lambda(lambda t: tf.add(t, tf.constant(1.0)), dtype="mixed_bfloat16")
    try:  # where tfmp's hook sees it: inside the layer call's re-raise, which drops the context
        shift.compute_output_spec(keras.KerasTensor((None, 2), dtype="bfloat16"))
    except NotImplementedError as error:
        replaced = error
    else:
        raise AssertionError("Keras inferred the shape of a Lambda mixing bfloat16 and float32")
    assert error_texts.LAMBDA_SHAPE.search(str(replaced))
    swallowed = error_texts.swallowed_by_lambda(replaced)
    assert sorted(error_texts.mismatched_dtypes(str(swallowed))) == ["bfloat16", "float32"]


def test_the_tflite_converter_tfmp_hooks_still_raises_naming_16bit_tensor_types():
    """`export_io.converter_classes` and `error_texts.converter_16bit_dtypes`: read by `deployment/tflite_hint.py`."""
    from tfmp._src.keras_hooks import error_texts, export_io

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, dtype="mixed_bfloat16")])
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    assert type(converter) in export_io.converter_classes()
    with pytest.raises(export_io.tflite_converter_error()) as refused:
        converter.convert()
    assert error_texts.converter_16bit_dtypes(str(refused.value)) == ["bfloat16"]
    scope = error_texts.converter_first_scope(str(refused.value))  # the layer's scope, as this TensorFlow writes it
    assert scope is not None and model.layers[0].name in scope, str(refused.value)[:400]


@pytest.mark.parametrize("location", [
    '"sequential_1/dense_1/MatMul@__inference_function_74"] at callsite(fused["StatefulPartitionedCall:", '
    '"StatefulPartitionedCall@__inference_signature_wrapper_93"]',  # TensorFlow 2.17-2.21
    '"sequential_1/dense_1/MatMul"]',  # tf-nightly 2.23.0.dev20261026
])
def test_the_converters_location_of_an_op_reads_in_either_form(location):
    from tfmp._src.keras_hooks import error_texts

    message = f'Could not translate MLIR to FlatBuffer.<unknown>:0: error: loc(fused["MatMul:", {location})'
    assert error_texts.converter_first_scope(message) == "sequential_1/dense_1"
    assert error_texts.converter_first_scope('error: loc(fused["MatMul:", "MatMul"])') is None


def test_keras_still_refuses_int8_for_float16_with_the_text_tfmp_reads():
    """`error_texts.QUANTIZE_FLOAT16`: read by tfmp's ``quantize`` hint (float16 models)."""
    from tfmp._src.keras_hooks import error_texts

    layer = keras.layers.Dense(2, dtype="mixed_float16")
    layer.build((None, 3))
    refused = _raised(lambda: layer.quantize("int8"))
    assert isinstance(refused, ValueError)
    assert error_texts.QUANTIZE_FLOAT16.search(str(refused)).group(1) == "int8"


def test_tensorflow_still_refuses_bfloat16_linalg_with_the_text_tfmp_reads():
    """`error_texts.REFUSED_DTYPE`: read when a Functional build fails (`unsafe_ops.force_at_build`)."""
    from tfmp._src.keras_hooks import error_texts

    spec = tf.TensorSpec((2, 2), tf.bfloat16)
    refused = _raised(lambda: tf.function(tf.linalg.inv).get_concrete_function(spec))
    assert isinstance(refused, TypeError)
    assert error_texts.refused_dtype(refused) == "bfloat16"


# Contracts with Keras's signatures and call order (keras_hooks/contracts.py) -----------


@pytest.mark.parametrize("cls, name, expected", contracts.HOOKED_SIGNATURES,
                         ids=[f"{cls.__name__}.{name}" for cls, name, _ in contracts.HOOKED_SIGNATURES])
def test_keras_still_has_each_hooked_signature(cls, name, expected):
    import inspect

    owner = patches.defining_class(cls, name)
    method = vars(owner)[name]
    parameters = list(inspect.signature(getattr(method, "__func__", method)).parameters)[1:]
    assert parameters[:len(expected)] == list(expected)


@pytest.mark.parametrize("function, expected", sorted(backend_ops.FUNCTION_SIGNATURES.items()))
def test_keras_still_has_each_hooked_backend_function_signature(function, expected):
    # A hook's pass-through carries the signature of the function it replaced.
    parameters = list(inspect.signature(getattr(backend_ops.module_of(function), function)).parameters)
    assert parameters[:len(expected)] == list(expected)


def test_every_call_order_contract_names_a_test_that_exists():
    import importlib

    for _, node in contracts.CALL_ORDER:
        path, name = node.split("::")
        module = importlib.import_module(pathlib.Path(path).stem)
        assert callable(getattr(module, name, None)), node


def test_the_oldest_ci_tier_runs_every_call_order_contract():
    """.ci/run's first tier (the oldest Keras/TensorFlow pair) names each contract's test or its file."""
    ci = (pathlib.Path(__file__).resolve().parents[1] / ".ci" / "run").read_text(encoding="utf-8")
    tier = ci[ci.index("OLDEST_TESTS=("):ci.index("PYTEST=(")]
    named = {word.strip('"()') for word in tier.split()}
    missing = [node for _, node in contracts.CALL_ORDER if not {node, node.split("::")[0]} & named]
    assert missing == []


def test_tensorflow_still_runs_an_op_gradient_in_the_gradient_frame():
    """`error_texts.GRADIENT_FRAME`: read where tfmp's tape hook catches (before TF filters the traceback)."""
    from tfmp._src.keras_hooks import error_texts

    seen = []

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with tf.name_scope("outer"):
                y = tf.matmul(x, x)
        try:  # a float32 gradient reaching a bfloat16 op's built-in gradient
            return tape.gradient(y, x, output_gradients=tf.ones((2, 2), tf.float32))
        except (TypeError, tf.errors.OpError) as error:
            seen.append((error_texts.is_dtype_mismatch(error, _first_line(error)),
                         list(error_texts.gradient_frames(error))[:1]))
            raise

    with pytest.raises(TypeError):
        tf.function(step, autograph=False)(tf.ones((2, 2), tf.bfloat16))
    with pytest.raises(tf.errors.InvalidArgumentError):
        step(tf.ones((2, 2), tf.bfloat16))  # eagerly: no scope recorded
    assert seen == [(True, [("outer/MatMul", ("float32",))]), (True, [("", ("float32",))])]


def test_a_step_scope_wraps_the_functions_keras_already_made_and_remove_gives_them_back():
    """`step_scope.install` wraps the train function Keras made before it, and each one Keras
    makes anew later; `remove` puts Keras's function back and the next steps run outside it."""
    import contextlib

    from tfmp._src.keras_hooks import step_scope

    entered = []

    @contextlib.contextmanager
    def scope():
        entered.append(True)
        yield

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    model.train_on_batch(x, y)
    made = model.train_function
    step_scope.install(model, scope, name="test scope")
    try:
        assert step_scope.scope_of(model) == "test scope"
        assert model.train_function is not made and model.train_function.tfmp_inner is made
        model.train_on_batch(x, y)
        assert entered
        model.make_train_function(force=True)  # a function Keras makes anew is wrapped too
        assert model.train_function.tfmp_scope == "test scope"
        made = model.train_function.tfmp_inner
        step_scope.remove(model)
        assert step_scope.scope_of(model) is None and model.train_function is made
        entered.clear()
        model.train_on_batch(x, y)
        assert not entered
    finally:
        step_scope.remove(model)


def test_a_train_step_check_added_after_keras_made_the_train_function_wraps_it_at_once():
    """`train_function.add_check` on a model whose train function Keras already made wraps that
    function at once (a custom loop calling ``model.train_function`` runs the check too, before
    any ``make_train_function``); removing the last check puts Keras's function back."""
    from tfmp._src.keras_hooks import train_function as step_checks

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.train_on_batch(np.ones((4, 2), "float32"), np.ones((4, 1), "float32"))
    made = model.train_function
    name = step_checks.CHECK_ORDER[0]
    step_checks.add_check(model, name, lambda logs: logs)
    try:
        assert model.train_function is not made and model.train_function.tfmp_inner is made
    finally:
        step_checks.remove_check(model, name)
    assert model.train_function is made


def test_keras_at_least_holds_for_the_installed_version_itself():
    """`versions.keras_at_least` is inclusive: the installed Keras is at least its own version."""
    major, minor = (int(part) for part in keras.__version__.split(".")[:2])
    assert versions.keras_at_least(keras.__version__) and versions.keras_at_least(f"{major}.{minor}")
    assert not versions.keras_at_least(f"{major}.{minor + 1}")


def test_tensorflow_names_a_traced_backward_pass_under_its_gradient_scopes():
    """`error_texts.in_backward_pass`: every op a tape's (but its seed) or `tf.gradients`' backward pass adds
    (a forward clip's gradient among them) is in it, none the user adds after it (`guard.clipped_while_scaled`)."""
    from tfmp._src.keras_hooks import error_texts

    names = {}

    @tf.function(autograph=False)
    def step(x):
        graph = tf.compat.v1.get_default_graph()
        with tf.GradientTape() as tape:
            tape.watch(x)
            with tf.name_scope("loss"):
                y = tf.reduce_sum(tf.math.log(tf.clip_by_value(x, 1e-7, 1.0)))
        forward = len(graph.get_operations())
        grads = tape.gradient(y, x)
        backward = len(graph.get_operations())
        (second,) = tf.gradients(y, x)
        gradients = len(graph.get_operations())
        clipped = tf.clip_by_global_norm([grads, second], 1.0)[0]
        operations = [op.name for op in graph.get_operations()]
        names.update(forward=operations[:forward], tape=operations[forward:backward],
                     gradients=operations[backward:gradients], after=operations[gradients:])
        return clipped

    step(tf.constant([0.5, 2.0]))
    assert any("clip_by_value" in name for name in names["tape"])  # the forward clip's gradient
    seed = [name for name in names["tape"] if not error_texts.in_backward_pass(name)]
    assert seed == ["ones"]  # the tape's output gradient, before its backward pass: no clip
    assert all(error_texts.in_backward_pass(name) for name in names["gradients"])
    assert not any(error_texts.in_backward_pass(name) for name in names["forward"] + names["after"])


def test_keras_projections_still_trace_to_the_ops_the_fused_cross_entropy_follows():
    """A Dense (3-D input, bias, a mixed policy's float32 variables) and a tied ReversibleEmbedding's
    reverse call trace to `projection_graph`'s pattern; a 2-D Dense without bias and a float32 one too."""
    projection_graph._probe()  # raises LookupError naming the layer whose graph moved
    found = []
    layers = (keras.layers.Dense(5, use_bias=False, dtype="mixed_float16"), keras.layers.Dense(5))
    for layer in layers:
        layer.build((None, 3))

    @tf.function(autograph=False)
    def trace(x):
        for layer in layers:
            found.append(projection_graph._walk(layer(tf.cast(x, layer.compute_dtype))))
        return x

    trace(tf.ones((2, 3)))
    assert [(p.transpose, p.bias is None, p.kernel.dtype, p.dtype) for p in found] == [
        (False, True, tf.float32, tf.float16), (False, False, tf.float32, tf.float32)]
