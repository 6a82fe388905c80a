"""TensorFlow's runtime options: the Grappler config of this thread's ``tf.function`` calls, the XLA context.

No hook: private accessors for the float16 remapper switch and the refusal of XLA steps under replicas.

| private name used | where in TensorFlow | what tfmp does with it |
|---|---|---|
| ``context.context().function_call_options`` (thread-local property with a setter) and ``context.FunctionCallOptions(executor_type, config_proto)`` | ``tensorflow/python/eager/context.py`` (read by ``Context.call_function`` and ``AtomicFunction`` at every call) | `function_call_config`: this thread's tf.function calls run with an edited Grappler config |
| ``control_flow_util.GraphOrParentsInXlaContext`` | ``tensorflow/python/ops/control_flow_util.py`` | `in_xla_context`: refuse XLA steps under several replicas |
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Tuple

import tensorflow as tf

from tfmp._src.keras_hooks import versions  # noqa: F401 (an unsupported pair fails at import)

#: (what tfmp relies on TensorFlow doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = (
    ("an eager tf.function call takes the calling thread's function_call_options as its Grappler "
     "config, and the runtime instantiates the function again for another config",
     "tests/test_float16_fusion.py::test_a_plain_tf_function_is_instantiated_with_and_without_the_remapper"),
)


def in_xla_context() -> bool:
    """Bool. True while tracing inside an XLA-compiled function (TensorFlow's own test)."""
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


@contextlib.contextmanager
def function_call_config(edit: Callable[[Any], None]) -> Iterator[None]:
    """Runs the block's tf.function calls, in this thread only, with a config `edit` changed in place.

    Each eager call takes the thread's ``FunctionCallOptions``, whose ``config_proto`` Grappler
    optimizes with (one instantiation per config). On exit the options before come back, unless
    a ``tf.config`` setter reset them meanwhile.
    """
    from tensorflow.python.eager import context

    eager = context.context()
    previous = eager.function_call_options
    config = function_call_config_now()
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
