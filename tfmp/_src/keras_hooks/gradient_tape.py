"""The gradient-tape surface: ``tf.GradientTape.gradient``, and where TensorFlow runs an op's gradient.

Subscriber: ``enable.gradient_errors`` (a backward-pass dtype mismatch re-raised naming the forward
layer, `tfmp._src.float32.gradient_errors`, reading `error_texts.GRADIENT_FRAME`).
"""

from __future__ import annotations

from typing import Callable, Tuple

import tensorflow as tf

from tfmp._src.keras_hooks import patches

SURFACE = patches.Surface("gradient tape", methods=("gradient",), subscribers=("enable.gradient_errors",))

#: (class whose method is hooked, method, the parameters tfmp relies on, in order).
SIGNATURES: Tuple[Tuple[type, str, Tuple[str, ...]], ...] = (
    # gradient_errors reads the sources.
    (tf.GradientTape, "gradient", ("target", "sources")),
)

#: (what tfmp relies on TensorFlow doing, the test that checks it).
CALL_ORDER: Tuple[Tuple[str, str], ...] = (
    ("train_step calls tf.GradientTape.gradient with the model's trainable weights as sources; "
     "a built-in op's gradient runs in error_texts.GRADIENT_FRAME, naming the forward layer's scope",
     "tests/test_user_code_dtypes.py::test_a_float32_gradient_returned_under_bfloat16_is_named_where_it_arrives"),
    ("tf.GradientTape.gradient runs a built-in op's gradient in error_texts.GRADIENT_FRAME",
     "tests/test_keras_hooks.py::test_tensorflow_still_runs_an_op_gradient_in_the_gradient_frame"),
    ("a traced tf.GradientTape.gradient (and tf.gradients) names each op of its backward pass, but the "
     "output gradient's seed, under error_texts.BACKWARD_PASS_SCOPE (the clipped-while-scaled guard)",
     "tests/test_keras_hooks.py::test_tensorflow_names_a_traced_backward_pass_under_its_gradient_scopes"),
    ("tape.gradient calls a tf.custom_gradient function below itself, in a frame of its own",
     "tests/test_user_code_dtypes.py::test_backward_error_in_fit_names_layer_dtypes_and_fix"),
)


def subscribe(wrap: Callable[[Callable], Callable], *, owner: str) -> patches.Hook:
    """Hooks ``tf.GradientTape.gradient`` for every tape (see `patches.Surface.subscribe`)."""
    return SURFACE.subscribe(tf.GradientTape, "gradient", wrap, owner=owner)
