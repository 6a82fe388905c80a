"""Loss scaling in custom training loops (Keras 3 has no `get_scaled_loss`).

In Keras 3 `optimizer.apply` unscales the gradients itself, so a custom loop scales
the loss, takes the gradients of the scaled loss and hands them to `apply` as they
are::

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tfmp.scaled_gradients(tape, loss, model.trainable_variables, optimizer)
    optimizer.apply(grads, model.trainable_variables)

Code moved from tf.keras 2 may keep `optimizer.get_scaled_loss(loss)` and
`optimizer.get_unscaled_gradients(grads)` followed by `apply_gradients`: after
`get_unscaled_gradients`, the next `apply` does not unscale a second time.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import tensorflow as tf


def scaled_gradients(
    tape: tf.GradientTape,
    loss: Any,
    variables: Sequence[Any],
    optimizer: keras.optimizers.Optimizer,
) -> list[Optional[tf.Tensor]]:
    """Gradients of `optimizer.scale_loss(loss)`, ready for `optimizer.apply`.

    Works for any Keras optimizer: a `LossScaleOptimizer` multiplies by its current
    loss scale (and records whether the loss is finite, for stuck detection), a
    plain optimizer by its `loss_scale_factor` (or not at all). `apply` divides by
    the same factor, so the update equals the unscaled float32 one. Do not unscale
    the returned gradients yourself.

    Args:
        tape: `tf.GradientTape` that recorded `loss`; not yet used for `gradient`
            unless persistent. The scaling is recorded on it too.
        loss: Scalar float tensor. The unscaled loss (float32 under mixed policies).
        variables: Sequence of `keras.Variable`. Usually
            `model.trainable_variables`.
        optimizer: `keras.optimizers.Optimizer`. The optimizer that will apply them.

    Returns:
        List with one tensor (or None, for an unconnected variable) per variable,
        still multiplied by the loss scale.
    """
    with tape:
        scaled_loss = optimizer.scale_loss(loss)
    return tape.gradient(scaled_loss, list(variables))
