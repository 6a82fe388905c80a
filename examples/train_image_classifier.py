"""Train a convolutional image classifier on MNIST or CIFAR-10 with tfmp.

Data comes through tensorflow-datasets, which downloads it on first use (needs a
network once; later runs read the local copy in ~/tensorflow_datasets).

    python examples/train_image_classifier.py            # cifar10, policy "auto"
    python examples/train_image_classifier.py --dataset mnist --epochs 2
    python examples/train_image_classifier.py --policy float32   # A/B baseline
    tensorboard --logdir logs/image_classifier
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

import example_args  # examples/, next to this file; imports no TensorFlow

DATASETS = ("cifar10", "mnist")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a CNN image classifier on a tensorflow-datasets data set "
        "with tfmp mixed precision; the loss scale and overflow count go to "
        "TensorBoard. The data set is downloaded on first use.",
        epilog="Example: %(prog)s --dataset mnist --epochs 2 --policy auto",
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="cifar10",
        help="cifar10 (default; 32x32 colour, 10 classes) or mnist (28x28 grey digits)",
    )
    example_args.add_data_dir_arg(parser)
    example_args.add_training_args(
        parser,
        epochs=10,
        batch_size=128,
        log_dir=os.path.join("logs", "image_classifier"),
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and usage errors answer here, before TensorFlow loads

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import example_utils  # noqa: E402  (examples/, next to this file)
import train_digits  # noqa: E402


def build_cnn(input_shape: Sequence[int], num_classes: int = 10) -> keras.Model:
    """A VGG-style classifier: two conv blocks, global pooling, softmax.

    Build it after `tfmp.enable()`. Under a mixed policy every layer computes in
    16 bits except the output Softmax, which tfmp forces to float32 at compile
    time; BatchNormalization keeps its 16-bit policy (Keras computes its
    statistics in float32). Channel counts are multiples of 8 (NVIDIA
    mixed-precision guide: Tensor Cores want dimensions that are multiples of 8).

    Args:
        input_shape: Sequence of ints. (height, width, channels), e.g. (32, 32, 3).
        num_classes: Int. Number of classes.

    Returns:
        Uncompiled `keras.Model` mapping float images in [0, 1] to class
        probabilities of shape (batch, num_classes).
    """
    inputs = keras.Input(shape=tuple(input_shape))
    x = inputs
    for filters in (32, 64):
        for _ in range(2):
            x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.ReLU()(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.2)(x)
    x = keras.layers.Dense(num_classes)(x)
    outputs = keras.layers.Softmax()(x)
    return keras.Model(inputs, outputs, name="cnn_classifier")


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Runs the job; returns the test accuracy (float in [0, 1])."""
    args = parse_args(argv)
    return example_utils.train_and_evaluate(
        args,
        lambda: train_digits.load_tfds(args.dataset, args.batch_size, args.data_dir),
        build_cnn,
    )


if __name__ == "__main__":
    main()
