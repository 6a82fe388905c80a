"""A Keras 3 custom training loop with tfmp loss scaling, clipping and accumulation.

`model.fit` does loss scaling for you; a hand-written loop must do three things
itself, in this order:

1. multiply the loss by the loss scale before taking gradients
   (`tfmp.scaled_gradients`), so that small float16 gradients do not underflow;
2. hand the still-scaled gradients to `tfmp.LossScaleOptimizer.apply`, which checks
   them for inf/NaN (skipping the step and lowering the scale if any), divides them
   by the scale, and only then lets the inner optimizer clip and accumulate them;
3. call `optimizer.raise_if_stuck()` between steps when the step is a
   `tf.function` (an eager `apply` does it by itself);
4. call the step inside `tfmp.step_scope(model)`, so that its graph is built with
   the options tfmp chose for the model's `fit` (on a CPU whose oneDNN takes
   float16, a `mixed_float16` model's steps run without Grappler's remapper):
   same graph, same kernels, same rounding as `model.fit`.

Clipping and accumulation are options of the inner optimizer (`global_clipnorm`,
`gradient_accumulation_steps`) because they must see unscaled gradients: a norm
clipped before unscaling is clipped `scale` times too hard, and scaled gradients
summed across micro-batches mix scales when the scale changes in between.

    python examples/custom_training_loop.py                 # digits, policy "auto"
    python examples/custom_training_loop.py --policy mixed_float16 --clipnorm 0.5
    tensorboard --logdir logs/custom_loop

notebooks/04_custom_training_loop.ipynb runs this loop and checks it against
`model.fit`.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, List, Optional, Sequence

import example_args  # examples/, next to this file; imports no TensorFlow


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train the digits classifier with a hand-written Keras 3 training "
        "loop: tfmp.scaled_gradients and tfmp.LossScaleOptimizer for loss scaling, "
        "gradient clipping and gradient accumulation in the inner optimizer; the loss "
        "scale and overflow count go to TensorBoard.",
        epilog="Example: %(prog)s --policy mixed_float16 --accumulation-steps 4",
    )
    example_args.add_training_args(
        parser, epochs=10, batch_size=32, log_dir=os.path.join("logs", "custom_loop")
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=0.05,
        help="SGD learning rate, momentum 0.9 (default 0.05)",
    )
    parser.add_argument(
        "--clipnorm",
        type=float,
        default=1.0,
        help="clip the global norm of the unscaled gradients to this "
        "(default 1.0; 0 disables clipping)",
    )
    parser.add_argument(
        "--accumulation-steps",
        type=int,
        default=2,
        help="average the gradients of this many batches before each "
        "update (default 2; 1 updates every batch)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and usage errors answer here, before TensorFlow loads
    example_args.require("sklearn", example_args.DIGITS_DATA)  # and a missing scikit-learn

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import example_utils  # noqa: E402  (examples/, next to this file)
import tfmp  # noqa: E402
import train_digits  # noqa: E402


def make_optimizer(
    learning_rate: float = 0.05,
    *,
    clipnorm: Optional[float] = 1.0,
    accumulation_steps: int = 1,
    **loss_scale_options,
) -> tfmp.LossScaleOptimizer:
    """SGD with momentum, gradient clipping and accumulation, under loss scaling.

    Dynamic loss scaling is on when the global policy computes in float16; under
    bfloat16 or float32 the scale stays 1.0 (their exponent range is float32's) and
    non-finite steps are still skipped and counted.

    Args:
        learning_rate: Float. SGD's learning rate.
        clipnorm: Float or None. Global-norm clipping threshold of the unscaled
            (and, with accumulation, averaged) gradients; None disables it.
        accumulation_steps: Int >= 1. Micro-batches whose gradients are averaged
            before one update; 1 updates on every batch.
        **loss_scale_options: Keyword arguments of `tfmp.LossScaleOptimizer`
            (e.g. ``initial_scale``, ``dynamic_growth_steps``).

    Returns:
        `tfmp.LossScaleOptimizer` wrapping `keras.optimizers.SGD`.
    """
    inner = keras.optimizers.SGD(
        learning_rate,
        momentum=0.9,
        global_clipnorm=clipnorm,
        gradient_accumulation_steps=accumulation_steps
        if accumulation_steps > 1
        else None,
    )
    loss_scale_options.setdefault(
        "loss_scaling", keras.config.dtype_policy().compute_dtype == "float16"
    )
    return tfmp.LossScaleOptimizer(inner, **loss_scale_options)


def make_train_step(
    model: keras.Model, optimizer: keras.optimizers.Optimizer, loss_fn: Callable
) -> Callable:
    """Builds one compiled training step: forward, scaled backward, optimizer update.

    Args:
        model: `keras.Model`. Its regularization losses (`model.losses`) are added.
        optimizer: `tfmp.LossScaleOptimizer` (any Keras optimizer works).
        loss_fn: Callable ``(y_true, y_pred) -> scalar float32 loss``.

    Returns:
        A `tf.function` ``(x, y) -> loss`` (the unscaled float32 loss of the batch).
    """

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = loss_fn(y, y_pred)
            if model.losses:
                loss = loss + tf.add_n(model.losses)
        # The gradients of loss * scale: still multiplied by the scale.
        grads = tfmp.scaled_gradients(tape, loss, model.trainable_variables, optimizer)
        # Checks for inf/NaN, unscales, clips, accumulates, updates.
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return train_step


def train(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    loss_fn: Callable,
    dataset: tf.data.Dataset,
    *,
    epochs: int = 1,
    steps: Optional[int] = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
) -> List[float]:
    """Runs the custom loop, calling callbacks as fit does.

    Callbacks such as `tfmp.LossScaleMonitor` read `model.optimizer`: compile the model
    with `optimizer` first.

    Args:
        model: `keras.Model`, compiled with `optimizer`.
        optimizer: The optimizer to step.
        loss_fn: Callable ``(y_true, y_pred) -> scalar loss``.
        dataset: `tf.data.Dataset` of ``(x, y)`` batches, iterated once per epoch.
        epochs: Int. Passes over `dataset`.
        steps: Int or None. Batches per epoch (None: the whole dataset).
        callbacks: Keras callbacks.

    Returns:
        List of floats: the loss of every step, in order.

    Raises:
        tfmp.NonFiniteError: The optimizer found the run stuck (see
            `tfmp.LossScaleOptimizer.raise_if_stuck`).
    """
    train_step = make_train_step(model, optimizer, loss_fn)
    callback_list = keras.callbacks.CallbackList(list(callbacks), model=model)
    losses: List[float] = []
    callback_list.on_train_begin()
    for epoch in range(epochs):
        callback_list.on_epoch_begin(epoch)
        epoch_losses = []
        batches = dataset.take(steps) if steps else dataset
        for step, (x, y) in enumerate(batches):
            callback_list.on_train_batch_begin(step)
            with tfmp.step_scope(model):  # fit's graph options (remapper) for this step
                loss = float(train_step(x, y))
            optimizer.raise_if_stuck()  # the step is a tf.function: check between steps
            epoch_losses.append(loss)
            callback_list.on_train_batch_end(step, {"loss": loss})
        losses += epoch_losses
        callback_list.on_epoch_end(
            epoch, {"loss": sum(epoch_losses) / len(epoch_losses)}
        )
    callback_list.on_train_end()
    return losses


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Runs the job; returns the test accuracy (float in [0, 1])."""
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    decision = tfmp.enable(args.policy)
    try:
        print(decision)
        train_ds, test_ds = train_digits.make_datasets(
            "digits", args.batch_size, args.seed
        )
        model = train_digits.build_model(train_ds.element_spec[0].shape[1:])
        optimizer = make_optimizer(
            args.learning_rate,
            clipnorm=args.clipnorm or None,
            accumulation_steps=args.accumulation_steps,
        )
        loss_fn = keras.losses.SparseCategoricalCrossentropy()
        # compile() does not train: it applies tfmp's float32 forcing, attaches the
        # optimizer (callbacks read model.optimizer) and prepares evaluate().
        model.compile(optimizer=optimizer, loss=loss_fn, metrics=["accuracy"])
        run_dir = example_utils.new_run_dir(args.log_dir)
        monitor = tfmp.LossScaleMonitor(run_dir, update_freq="batch")
        losses = train(
            model,
            optimizer,
            loss_fn,
            train_ds,
            epochs=args.epochs,
            steps=args.steps,
            callbacks=[monitor],
        )
        _, accuracy = model.evaluate(test_ds, verbose=0)
        skipped = int(optimizer.overflow_count.numpy())
        state = f"loss scale {optimizer.loss_scale:g}, {skipped} skipped steps"
    finally:
        tfmp.disable()
    print(f"{len(losses)} steps, last loss {losses[-1]:.4f}, {state}")
    print(f"Test accuracy ({decision.policy}): {accuracy:.4f}")
    print(f"TensorBoard logs: tensorboard --logdir {args.log_dir} (this run: {run_dir})")
    return float(accuracy)


if __name__ == "__main__":
    main()
