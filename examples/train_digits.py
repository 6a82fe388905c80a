"""Main job: train a small classifier with tfmp mixed precision and TensorBoard logs.

Default data: scikit-learn's bundled handwritten digits (1,797 real 8x8 grey
images, no network needed). With a network, ``--dataset mnist`` or
``--dataset cifar10`` loads through tensorflow-datasets instead.

    python examples/train_digits.py                 # digits, policy "auto"
    python examples/train_digits.py --policy float32 --epochs 5
    python examples/train_digits.py --policy mixed_float16 --filters 4 --units 16
    tensorboard --logdir logs/digits                # opens on the loss and metrics

It prints the policy and why it was chosen, then, at compile, what tfmp did to
the model (layers forced to float32, the optimizer wrapped), then Keras's
progress bars.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence, Tuple

import example_args  # examples/, next to this file; imports no TensorFlow

DATASETS = ("digits", "mnist", "cifar10")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a classifier with tfmp mixed precision, logging the "
        "loss scale and overflow count to TensorBoard."
    )
    parser.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="digits (bundled, default) or a tensorflow-datasets "
                        "name (needs a network the first time)")
    example_args.add_data_dir_arg(parser)
    example_args.add_training_args(parser, epochs=15, batch_size=64,
                                   log_dir=os.path.join("logs", "digits"))
    parser.add_argument("--filters", type=example_args.positive_int, default=32,
                        help="filters of the 3x3 convolution (default 32)")
    parser.add_argument("--units", type=example_args.positive_int, default=128,
                        help="units of the hidden Dense layer (default 128); "
                        "--filters 4 --units 16 keeps a float16 run on a CPU short")
    return parser.parse_args(argv)


if __name__ == "__main__":
    # --help, usage errors and a missing scikit-learn answer here, before TensorFlow loads
    if parse_args().dataset == "digits":
        example_args.require("sklearn", example_args.DIGITS_DATA)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import example_utils  # noqa: E402  (examples/, next to this file)
import tfds_preflight  # noqa: E402

NUM_CLASSES = 10
#: Loss scaling made visible within one short run (about 345 steps): start at
#: 2**24 (the default `max_scale`), far above what this model's float16
#: gradients bear, so the first steps overflow and halve it; then try to double
#: it after every 20 finite steps instead of Keras's 2000, so the scale keeps
#: probing upwards and backing off. Keras's defaults (2**15, 2000) would leave it
#: flat. Under bfloat16 and float32 the scale stays 1 (tfmp only skips and counts
#: non-finite steps there).
LOSS_SCALE_OPTIONS = {"initial_scale": 2.0**24, "dynamic_growth_steps": 20}
#: Steps between two gradient norm / update ratio computations (every step
#: would cost about a tenth more CPU time here).
GRAD_STATS_FREQ = 5


def load_digits_arrays(
    test_fraction: float = 0.2, seed: int = 0
) -> Tuple[Tuple[np.ndarray, np.ndarray], Tuple[np.ndarray, np.ndarray]]:
    """Loads scikit-learn's digits as float32 images in [0, 1], split train/test.

    Args:
        test_fraction: Float in (0, 1). Share of the 1,797 images held out.
        seed: Int. Seed of the stratified split.

    Returns:
        ``((x_train, y_train), (x_test, y_test))``: images of shape (n, 8, 8, 1),
        dtype float32; labels of shape (n,), dtype int32.

    Raises:
        SystemExit: scikit-learn cannot be imported (`example_args.require`:
            the message names the ``examples`` extra).
    """
    example_args.require("sklearn", example_args.DIGITS_DATA)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., np.newaxis]
    labels = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    return (x_train, y_train), (x_test, y_test)


def load_tfds(
    name: str, batch_size: int, data_dir: Optional[str] = None
) -> Tuple[tf.data.Dataset, tf.data.Dataset]:
    """Loads `name` ("mnist" or "cifar10") through tensorflow-datasets.

    A data set not yet prepared is downloaded only when its hosts answer
    (`tfds_preflight.prepare`); otherwise the run stops at once with what to do.

    Args:
        name: String. A tensorflow-datasets name with ``image`` and ``label``.
        batch_size: Int. Examples per batch.
        data_dir: String or None. Folder of prepared data sets (None: tfds's
            default, ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).

    Returns:
        ``(train, test)`` batched `tf.data.Dataset`s of (float32 image in [0, 1],
        int64 label).

    Raises:
        SystemExit: the data set is not prepared and its download host is
            unreachable, or the download failed (its partial folders removed).
    """
    def scale(image, label):
        return tf.cast(image, tf.float32) / 255.0, label

    builder = tfds_preflight.prepare(name, data_dir)
    train, test = builder.as_dataset(split=["train", "test"], as_supervised=True)
    train = train.map(scale).shuffle(10_000, seed=0).batch(batch_size)
    return train.prefetch(tf.data.AUTOTUNE), test.map(scale).batch(batch_size)


def make_datasets(
    dataset: str, batch_size: int, seed: int = 0, data_dir: Optional[str] = None
) -> Tuple[tf.data.Dataset, tf.data.Dataset]:
    """Returns batched ``(train, test)`` `tf.data` pipelines for `dataset`.

    `data_dir` is the tensorflow-datasets folder (see `load_tfds`).

    Raises:
        ValueError: `dataset` is not one of "digits", "mnist", "cifar10".
    """
    if dataset == "digits":
        (x_train, y_train), (x_test, y_test) = load_digits_arrays(seed=seed)
        train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).cache()
        train = train.shuffle(len(x_train), seed=seed).batch(batch_size)
        test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size)
        return train.prefetch(tf.data.AUTOTUNE), test.cache()
    if dataset in ("mnist", "cifar10"):
        return load_tfds(dataset, batch_size, data_dir)
    raise ValueError(
        f"Invalid `dataset` argument. Expected one of {DATASETS}. "
        f"Received: dataset={dataset!r}. Use --dataset digits for the bundled data."
    )


#: Widths of `build_model` for float16 demos on a CPU (notebooks 01, 04 and 05,
#: README's screenshot run): a float16 training step on a CPU is emulated, and on
#: Sapphire Rapids TensorFlow 2.21 fuses float16 MatMul+BiasAdd into a oneDNN
#: kernel that takes 10-20 ns per multiply-add (measured there: a 1024-1024-1024-10
#: MLP at batch 256 steps in 17 s against 35 ms in float32, notebook 02's 64-1024-
#: 1024-10 MLP in 16 s against 29 ms; notebook 05's two runs of 180 steps of this
#: model's default widths took 137 s). Four filters and 16 units (4,338 weights)
#: cut the default 280,000 multiply-adds per image to 6,560: at 20 ns (forward and
#: backward, three multiply-adds per weight and image) 200 float16 steps of 64
#: images take about 5 s there instead of 215 s.
FLOAT16_DEMO_WIDTHS = {"filters": 4, "units": 16}


def build_model(
    input_shape: Sequence[int], filters: int = 32, units: int = 128
) -> keras.Model:
    """A small convolutional classifier; build it after `tfmp.enable()`.

    Args:
        input_shape: Sequence of ints, e.g. ``(8, 8, 1)``.
        filters: Int. Filters of the 3x3 convolution.
        units: Int. Units of the hidden Dense layer.

    Returns:
        Uncompiled `keras.Model` mapping images to 10 class probabilities.
        The default widths are multiples of 8 (NVIDIA mixed-precision guide:
        Tensor Core dims should be multiples of 8).
    """
    inputs = keras.Input(shape=tuple(input_shape))
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(units, activation="relu")(x)
    x = keras.layers.Dense(NUM_CLASSES)(x)
    outputs = keras.layers.Softmax()(x)
    return keras.Model(inputs, outputs, name="digits_classifier")


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Runs the job; returns the test accuracy (float in [0, 1])."""
    args = parse_args(argv)
    return example_utils.train_and_evaluate(
        args,
        lambda: make_datasets(args.dataset, args.batch_size, args.seed, args.data_dir),
        lambda input_shape: build_model(input_shape, args.filters, args.units),
        loss_scale_options=LOSS_SCALE_OPTIONS,
        grad_stats_freq=GRAD_STATS_FREQ,
    )


if __name__ == "__main__":
    main()
