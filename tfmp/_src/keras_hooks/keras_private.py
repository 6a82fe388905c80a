"""Every private Keras and TensorFlow name tfmp relies on, in one place.

Nothing else in tfmp reads or writes an underscore attribute of a Keras object or
imports from ``keras.src`` / ``tensorflow.python``: it calls the functions below.
When Keras changes one of them, `tests/test_keras_hooks.py` fails here, by name.
Checked on Keras 3.15.1 and TensorFlow 2.21.0 (``CHECKED_ON``), and on the oldest
pair setup.cfg admits.

| name used | where in Keras / TF | what tfmp does with it |
|---|---|---|
| ``global_state`` attribute ``"current_call_ctx"`` (``CallContext.entry_layer``) | ``keras/src/layers/layer.py`` | `entry_layer`: the outermost layer whose call is running in this thread |
| ``global_state`` attribute ``"name_scope_stack"`` (each ``name_scope``'s ``caller``: the layer whose ``__call__`` opened it) | ``keras/src/backend/common/name_scope.py``, ``Layer._open_name_scope`` in ``keras/src/layers/layer.py`` | `calling_layer`: the innermost layer whose call is running in this thread |
| ``Layer._flatten_layers`` | ``keras/src/layers/layer.py`` | `child_layers`: the direct sublayers of a layer, tracked attributes included |
| ``Sequential._functional`` | ``keras/src/models/sequential.py`` | `functional_graph`: a built Sequential's inner graph |
| the class ``Functional`` (``keras.Model(inputs, outputs)``), not public | ``keras/src/models/functional.py`` | `is_functional`: a graph of layers that computes nothing itself (not a subclass) |
| ``Functional._nodes_by_depth`` | ``keras/src/ops/function.py`` | `nodes_by_depth`: the graph's nodes, to refresh symbolic dtypes |
| ``KerasTensor._keras_history`` | ``keras/src/backend/common/keras_tensor.py`` | `keras_history`: the operation that made a symbolic tensor |
| ``Operation._inbound_nodes`` | ``keras/src/ops/operation.py`` | `inbound_node`: the node of a raw op, to walk back to output layers; `first_call_arguments`: a layer's first call in a graph (``Node.arguments``), traced by `tfmp._src.float32.reductions` |
| ``KerasTensor._dtype`` | ``keras/src/backend/common/keras_tensor.py`` | `set_symbolic_dtype`: a forced layer's new output dtype in the graph |
| ``Layer._convert_input_args`` | ``keras/src/layers/layer.py`` | `autocasts_inputs`: whether ``__call__`` casts float inputs |
| ``Trainer._loss_tracker`` | ``keras/src/trainers/trainer.py`` | `loss_tracker`: samples seen this epoch (the monitor's throughput) |
| ``Trainer.compile`` identity in ``compile_from_config`` | ``keras/src/trainers/trainer.py`` | the compile hook is set on the class that defines ``compile`` (`defining_class`), so loading still compiles |
| ``Optimizer._trainable_variables`` | ``keras/src/optimizers/base_optimizer.py`` | `optimizer_variables`: variables ``apply`` defaults to |
| ``Optimizer._overwrite_variable_with_gradient`` | same | `overwrites_with_gradient`: variables whose "gradient" is a new value, never unscaled |
| ``Optimizer._get_variable_index``, ``Adam._momentums`` / ``_velocities`` | ``keras/src/optimizers/base_optimizer.py``, ``keras/src/optimizers/adam.py`` | `adam_slots`, `sgd_momentum_slot`: a variable's slots (Adam's first and second moments, SGD's momentum), updated by `tfmp._src.loss_scale.fused_update` |
| ``LossScaleOptimizer._stateful_handle_finite_grads`` / ``_stateful_handle_non_finite_grads`` | ``keras/src/optimizers/loss_scale_optimizer.py`` | overridden by `LossScaleOptimizerBase` only |
| ``keras.src.utils.tracking.no_automatic_dependency_tracking`` | ``keras/src/utils/tracking.py`` | `no_automatic_dependency_tracking`: tfmp's optimizer variables stored as attributes |
| ``control_flow_util.GraphOrParentsInXlaContext`` | ``tensorflow/python/ops/control_flow_util.py`` | `in_xla_context`: refuse XLA steps under several replicas |
| ``keras.src.export.export_utils.get_input_signature`` | ``keras/src/export/export_utils.py`` | `export_input_specs`: the inputs `Model.export` gives the serving signature, checked by `tfmp.export` before it writes |
| ``convert_phase.ConverterError`` | ``tensorflow/lite/python/convert_phase.py`` | `tflite_converter_error`: the one error type `TFLiteConverter.convert` raises, caught by `tfmp.export` |
| ``keras.src.backend.tensorflow.nn`` (the module ``keras.ops.gelu`` reads ``gelu`` from at each call, as ``backend.nn``) | ``keras/src/backend/tensorflow/nn.py``, ``keras/src/ops/nn.py`` | `backend_nn`: the module whose ``gelu`` `tfmp._src.float32.gelu` hooks, and whose ``conv`` and ``conv_transpose`` `tfmp._src.float32.conv` hooks |
| ``keras.src.backend.tensorflow.numpy`` (the module ``keras.ops.add`` reads ``add`` from at each call, as ``backend.numpy``; its ``add`` takes ``tf.nn.bias_add`` for a bias vector) | ``keras/src/backend/tensorflow/numpy.py``, ``keras/src/ops/numpy.py`` | `backend_numpy`: the module whose ``add`` `tfmp._src.float32.bias_gradient` hooks |
| ``context.context().function_call_options`` (thread-local property with a setter) and ``context.FunctionCallOptions(executor_type, config_proto)`` | ``tensorflow/python/eager/context.py`` (read by ``Context.call_function`` and ``AtomicFunction`` at every call) | `function_call_config`: this thread's tf.function calls run with an edited Grappler config (`tfmp._src.policy.float16_fusion` turns the remapper off) |
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator, List, Optional

import keras
import tensorflow as tf

#: The (Keras, TensorFlow) versions these accessors were last checked against.
CHECKED_ON = ("3.15.1", "2.21.0")

#: The oldest (Keras, TensorFlow) versions tfmp supports: the pair `.ci/run` tests
#: in a second environment, and the lower bounds of setup.cfg's install_requires.
#: Keras 3.11 and older fail tfmp's tests; Keras 4 is not yet known.
MIN_KERAS = (3, 12, 0)
MIN_TENSORFLOW = (2, 17, 0)
BELOW_KERAS = (4, 0, 0)
#: The newest (major, minor) of Keras and TensorFlow a `.ci/run` tier tests (the
#: pinned pre-releases, keras-nightly 3.16 and tf-nightly 2.23): setup.cfg's upper
#: bounds admit these and no newer minor. `import tfmp` still takes a newer minor
#: (a user who forces one gets the optional features' own checks), not Keras 4.
NEWEST_TESTED_KERAS = (3, 16)
NEWEST_TESTED_TENSORFLOW = (2, 23)


def _version_tuple(version: str) -> tuple:
    """(major, minor, patch) of a version string such as "3.15.1" or "2.16.0rc1"."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(part or 0) for part in match.groups()) if match else (0, 0, 0)


def keras_at_least(version: str) -> bool:
    """Bool. Whether the installed Keras is `version` (e.g. ``"3.15"``) or newer."""
    return _version_tuple(keras.__version__) >= _version_tuple(version)


def check_versions(keras_version: str, tensorflow_version: str) -> None:
    """Refuses a Keras or TensorFlow outside the range tfmp is tested on.

    Args:
        keras_version: String, e.g. ``keras.__version__`` (``"3.15.1"``).
        tensorflow_version: String, e.g. ``tf.__version__`` (``"2.21.0"``).

    Raises:
        ImportError: naming the installed and the supported versions, and the fix.
    """
    dotted = lambda v: ".".join(map(str, v))  # noqa: E731
    keras_ok = MIN_KERAS <= _version_tuple(keras_version) < BELOW_KERAS
    tensorflow_ok = _version_tuple(tensorflow_version) >= MIN_TENSORFLOW
    if keras_ok and tensorflow_ok:
        return
    raise ImportError(
        f"tfmp supports Keras >= {dotted(MIN_KERAS)}, < {dotted(BELOW_KERAS)} with TensorFlow >= "
        f"{dotted(MIN_TENSORFLOW)}. Received: keras=={keras_version}, tensorflow=={tensorflow_version}. "
        f"Install a supported pair, e.g. pip install 'keras>={dotted(MIN_KERAS)},<4' "
        f"'tensorflow>={dotted(MIN_TENSORFLOW)}'."
    )


# Every part of tfmp imports this module: an unsupported pair fails at `import tfmp`.
check_versions(keras.__version__, tf.__version__)

#: (class, attribute) pairs that must exist on the installed Keras's classes; the
#: test suite checks every one (and runs each accessor below on a real model, for
#: the instance attributes), so an upgrade that renames one fails in one place.
REQUIRED_ATTRIBUTES = (
    (keras.layers.Layer, "_flatten_layers"),
    (keras.optimizers.Optimizer, "_overwrite_variable_with_gradient"),
    (keras.optimizers.Optimizer, "_get_variable_index"),
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_finite_grads"),
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_non_finite_grads"),
)


def child_layers(layer: Any) -> List[Any]:
    """List of `keras.layers.Layer`: the direct sublayers of `layer`, in order.

    Includes sublayers held in attributes, lists and dicts (what Keras tracks),
    which `layer.layers` (models only) does not list for subclassed layers.
    """
    return list(layer._flatten_layers(include_self=False, recursive=False))


def functional_graph(model: Any) -> Optional[Any]:
    """The Functional graph behind `model`, or None (subclassed, unbuilt Sequential).

    A built `keras.Sequential` keeps its graph in a private inner Functional model.
    """
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if hasattr(model, "_nodes_by_depth"):
        return model
    return None


def entry_layer() -> Optional[Any]:
    """The outermost layer (usually the model) whose ``__call__`` runs in this thread, or None."""
    from keras.src.backend.common import global_state

    return getattr(global_state.get_global_attribute("current_call_ctx"), "entry_layer", None)


def calling_layer() -> Optional[Any]:
    """The innermost layer whose ``__call__`` runs in this thread, or None.

    Keras's ``Layer.__call__`` runs ``call`` inside ``backend.name_scope(self.name,
    caller=self)``, pushed on the thread's name scope stack.
    """
    from keras.src.backend.common import global_state

    for scope in reversed(global_state.get_global_attribute("name_scope_stack") or []):
        caller = getattr(scope, "caller", None)
        if isinstance(caller, keras.layers.Layer):
            return caller
    return None


def backend_numpy() -> Any:
    """The module of Keras's TensorFlow backend ops that ``keras.ops`` calls (``backend.numpy``)."""
    from keras.src import backend

    return backend.numpy


def backend_nn() -> Any:
    """The module of Keras's TensorFlow backend ops that ``keras.ops`` calls (``backend.nn``)."""
    from keras.src import backend

    return backend.nn


def is_functional(layer: Any) -> bool:
    """Bool. `layer` is a plain ``keras.Model(inputs, outputs)`` (Keras's ``Functional``), no subclass."""
    from keras.src.models.functional import Functional

    return type(layer) is Functional


def nodes_by_depth(graph: Any) -> dict:
    """Dict from depth (int, 0 = outputs) to the list of `Node`s of a Functional graph."""
    return graph._nodes_by_depth


def keras_history(tensor: Any) -> Optional[Any]:
    """The `KerasHistory` (operation, node_index, tensor_index) of a symbolic tensor, or None."""
    return getattr(tensor, "_keras_history", None)


def inbound_node(operation: Any, node_index: int) -> Any:
    """The `Node` at `node_index` among the calls of `operation` (a layer or raw op)."""
    return operation._inbound_nodes[node_index]


def first_call_arguments(layer: Any) -> Optional[tuple]:
    """``(args, kwargs)`` (of `KerasTensor`s) of `layer`'s first call in a Functional graph, or None."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    if not nodes:
        return None
    return tuple(nodes[0].arguments.args), dict(nodes[0].arguments.kwargs)


def set_symbolic_dtype(tensor: Any, dtype: str) -> None:
    """Writes `dtype` into a `KerasTensor` in place (it has no public setter).

    The graph's tensors are referred to by identity by every downstream node, so a
    new tensor cannot replace them; Keras's own `compute_output_shape` writes the
    same slot.
    """
    tensor._dtype = dtype


def autocasts_inputs(layer: Any) -> bool:
    """Bool. True when `layer.__call__` casts floating inputs to its compute dtype."""
    return bool(isinstance(layer, keras.layers.Layer) and layer._convert_input_args and layer.autocast)


#: The method ``Layer.__setattr__`` calls first, with ``(name, value)``, storing
#: the pair it returns (Keras's per-backend hook; ``Operation``'s returns both
#: unchanged). `tfmp._src.loss_scale.custom_optimizers` hooks it per model.
SETATTR_HOOK = "_setattr_hook"


def loss_tracker(model: Any) -> Optional[Any]:
    """The `keras.metrics.Mean` a compiled model updates with each batch's loss, or None."""
    return getattr(model, "_loss_tracker", None)


def optimizer_variables(optimizer: Any) -> list:
    """The trainable variables `optimizer.apply` uses when it is given none."""
    return list(optimizer._trainable_variables)


def overwrites_with_gradient(optimizer: Any, variable: Any) -> bool:
    """Bool. True when `optimizer` assigns the "gradient" of `variable` as its value.

    Keras uses this for float8 scaling factors (`overwrite_with_gradient`); such a
    gradient must not be unscaled.
    """
    return bool(optimizer._overwrite_variable_with_gradient(variable))


def adam_slots(optimizer: Any, variable: Any) -> tuple:
    """(first moment, second moment): the `keras.Variable` slots a built Adam keeps for `variable`."""
    index = optimizer._get_variable_index(variable)
    return optimizer._momentums[index], optimizer._velocities[index]


def sgd_momentum_slot(optimizer: Any, variable: Any) -> Any:
    """The `keras.Variable` momentum slot a built SGD (``momentum > 0``) keeps for `variable`."""
    return optimizer.momentums[optimizer._get_variable_index(variable)]


def no_automatic_dependency_tracking(function: Callable) -> Callable:
    """Keras's decorator: attributes set inside `function` are not tracked twice."""
    from keras.src.utils.tracking import no_automatic_dependency_tracking as decorator

    return decorator(function)


def in_xla_context() -> bool:
    """Bool. True while tracing inside an XLA-compiled function (TensorFlow's own test)."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


@contextlib.contextmanager
def build_state_restored_on_error(layer: Any) -> Iterator[None]:
    """Puts `layer`'s build state back if the block raises before building anything.

    Keras marks a layer built, records its input shapes (``get_build_config``, saved
    with the model) and locks its state tracker when its first call starts, before
    ``call`` runs; a call that fails (a subclassed GAN without ``call``) would leave
    ``{"input_shape": None}``, which no later load can build from. When the failed
    block created no variable, built flag, shapes and lock go back as they were;
    when it did, the layer stays built (building again would make them twice).
    """
    built, shapes, locked = layer.built, layer._build_shapes_dict, layer._tracker.locked
    created: List[Any] = []

    def remember(next_creator: Any, **kwargs: Any) -> Any:
        created.append(next_creator(**kwargs))
        return created[-1]

    try:
        with tf.variable_creator_scope(remember):
            yield
    except BaseException:
        if not created:
            layer.built, layer._build_shapes_dict = built, shapes
            if not locked:
                layer._tracker.unlock()
        raise


def defining_class(cls: type, name: str) -> type:
    """The class in `cls.__mro__` whose own namespace defines `name`.

    The compile hook patches `compile` where Keras defines it (the trainer base
    class), not on `keras.Model`: Keras's `compile_from_config` treats a model whose
    ``compile`` differs from the trainer's as user-overridden and skips compiling.

    Raises:
        AttributeError: No class of the MRO defines `name`.
    """
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    raise AttributeError(f"No class in the MRO of {cls.__name__} defines {name!r}.")


class LossScaleOptimizerBase(keras.optimizers.LossScaleOptimizer):
    """Keras's `LossScaleOptimizer` with its two private step handlers renamed.

    Keras's TensorFlow path calls `_stateful_handle_finite_grads(grads, variables)`
    when every gradient is finite and `_stateful_handle_non_finite_grads()`
    otherwise. Subclasses implement `_finite_step` and `_non_finite_step` instead,
    so the private names appear only here.
    """

    def _stateful_handle_finite_grads(self, grads: list, trainable_variables: Optional[list]) -> None:
        self._finite_step(grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self) -> None:
        self._non_finite_step()

    def _finite_step(self, grads: list, trainable_variables: Optional[list]) -> None:
        super()._stateful_handle_finite_grads(grads, trainable_variables)

    def _non_finite_step(self) -> None:
        super()._stateful_handle_non_finite_grads()


@contextlib.contextmanager
def function_call_config(edit: Callable[[Any], None]) -> Iterator[None]:
    """Runs the block's tf.function calls, in this thread only, with an edited config.

    TensorFlow hands each eager call of a `tf.function` the calling thread's
    ``FunctionCallOptions``; their ``config_proto`` is the config Grappler
    optimizes the function with, and the runtime instantiates a function once
    per distinct config. A copy of the thread's config, changed by `edit`, is
    set for the block; on exit the options in force before are put back, unless
    TensorFlow dropped the block's own meanwhile (a ``tf.config`` setter resets
    them), whose reset then stands. Other threads never see the change.

    Args:
        edit: Callable taking a `tf.compat.v1.ConfigProto` (a copy) and changing
            it in place, e.g. setting
            ``config.graph_options.rewrite_options.remapping``.
    """
    from tensorflow.python.eager import context

    eager = context.context()
    previous = eager.function_call_options
    config = tf.compat.v1.ConfigProto()
    config.ParseFromString(previous.config_proto_serialized)
    edit(config)
    options = context.FunctionCallOptions(executor_type=previous.executor_type, config_proto=config)
    eager.function_call_options = options
    try:
        yield
    finally:
        if eager.function_call_options is options:
            eager.function_call_options = previous


def function_call_config_now() -> Any:
    """`tf.compat.v1.ConfigProto`: a copy of the config this thread's tf.function calls get now."""
    from tensorflow.python.eager import context

    config = tf.compat.v1.ConfigProto()
    config.ParseFromString(context.context().function_call_options.config_proto_serialized)
    return config


def tflite_converter_error() -> type:
    """The exception class `tf.lite.TFLiteConverter.convert` raises (not exported by `tf.lite`)."""
    from tensorflow.lite.python.convert_phase import ConverterError

    return ConverterError


def export_input_specs(model: Any) -> List[Any]:
    """The `keras.InputSpec` of each input `model.export` writes into the serving signature.

    Flattened as `tf.nest.flatten` flattens the model's inputs. Raises Keras's
    ValueError for a subclassed model that was built but never called.
    """
    from keras.src.export.export_utils import get_input_signature

    return keras.tree.flatten(get_input_signature(model))
