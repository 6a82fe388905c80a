"""Train a small Transformer text classifier on IMDB reviews with tfmp.

The data (50,000 movie reviews labelled positive or negative) comes through
tensorflow-datasets as ``imdb_reviews``, downloaded on first use (needs a network
once). A `TextVectorization` layer turns each review into a fixed-length sequence of
token ids inside the `tf.data` pipeline; the model is one Transformer encoder
block (self-attention and a feed-forward network, each with a residual connection
and layer normalization), averaged over the sequence, then a softmax.

    python examples/train_text_transformer.py                  # policy "auto"
    python examples/train_text_transformer.py --epochs 1 --steps 100
    tensorboard --logdir logs/text_transformer

Mixed precision in attention: the query-key products are computed in 16 bits,
the attention softmax in float32 (tfmp forces `MultiHeadAttention`'s Softmax
sublayer, which hands 16-bit probabilities back to the attention; the fused kernel
does it by itself), and so are the output layers. The LayerNormalization layers
sum squares, which overflow float16 beyond 65504: Keras 3.15 computes them in
float32 inside the layer, so they keep the 16-bit policy.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence, Tuple

import example_args  # examples/, next to this file; imports no TensorFlow


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a one-block Transformer on IMDB movie reviews "
        "(tensorflow-datasets 'imdb_reviews', downloaded on first use) with tfmp "
        "mixed precision; the loss scale and overflow count go to TensorBoard.",
        epilog="Example: %(prog)s --epochs 1 --steps 100 --policy auto",
    )
    example_args.add_training_args(
        parser,
        epochs=2,
        batch_size=64,
        log_dir=os.path.join("logs", "text_transformer"),
    )
    example_args.add_data_dir_arg(parser)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=20_000,
        help="vocabulary size learnt from the training reviews (default 20000)",
    )
    parser.add_argument(
        "--sequence-length",
        type=int,
        default=200,
        help="tokens kept per review; shorter ones are padded (default 200)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and usage errors answer here, before TensorFlow loads

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

import example_utils  # noqa: E402  (examples/, next to this file)
import tfds_preflight  # noqa: E402


def load_imdb(
    batch_size: int,
    max_tokens: int,
    sequence_length: int,
    seed: int = 0,
    data_dir: Optional[str] = None,
) -> Tuple[tf.data.Dataset, tf.data.Dataset]:
    """Loads ``imdb_reviews`` and turns reviews into token ids.

    The vocabulary (the `max_tokens` most frequent words of the training reviews)
    is learnt with `TextVectorization.adapt`; ids 0 and 1 are padding and
    out-of-vocabulary.

    Args:
        batch_size: Int. Reviews per batch.
        max_tokens: Int. Vocabulary size, including the two reserved ids.
        sequence_length: Int. Reviews are cut or zero-padded to this many tokens.
        seed: Int. Seed of the training shuffle.
        data_dir: String or None. Folder of prepared tensorflow-datasets data
            sets (None: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).

    Returns:
        ``(train, test)`` batched datasets of (int64 ids of shape
        (batch, sequence_length), int64 label 0 = negative, 1 = positive).
    """
    builder = tfds_preflight.prepare("imdb_reviews", data_dir)
    train, test = builder.as_dataset(split=["train", "test"], as_supervised=True)
    vectorizer = keras.layers.TextVectorization(
        max_tokens=max_tokens, output_sequence_length=sequence_length
    )
    vectorizer.adapt(train.map(lambda text, label: text).batch(1024))

    def vectorize(text, label):
        return vectorizer(text), label

    train = train.shuffle(10_000, seed=seed).batch(batch_size).map(vectorize)
    test = test.batch(batch_size).map(vectorize)
    return train.prefetch(tf.data.AUTOTUNE), test.prefetch(tf.data.AUTOTUNE)


@keras.saving.register_keras_serializable(package="tfmp_examples")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Sum of a token embedding and a learnt position embedding.

    Args:
        sequence_length: Int. Longest sequence the positions cover.
        vocabulary_size: Int. Number of token ids.
        width: Int. Embedding width (the model width).
    """

    def __init__(
        self, sequence_length: int, vocabulary_size: int, width: int, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.sequence_length = sequence_length
        self.vocabulary_size = vocabulary_size
        self.width = width
        self.tokens = keras.layers.Embedding(
            vocabulary_size, width, dtype=self.dtype_policy
        )
        self.positions = keras.layers.Embedding(
            sequence_length, width, dtype=self.dtype_policy
        )

    def call(self, ids):
        positions = ops.arange(ops.shape(ids)[-1])
        # Both embeddings return the compute dtype (bfloat16 / float16 under a
        # mixed policy); their tables stay float32.
        return self.tokens(ids) + self.positions(positions)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            sequence_length=self.sequence_length,
            vocabulary_size=self.vocabulary_size,
            width=self.width,
        )
        return config


def build_transformer(
    input_shape: Sequence[int],
    vocabulary_size: int = 20_000,
    width: int = 64,
    heads: int = 2,
    feed_forward: int = 128,
    num_classes: int = 2,
) -> keras.Model:
    """One post-norm Transformer encoder block over token embeddings.

    Build it after `tfmp.enable()`. Widths are multiples of 8 for Tensor Cores.

    Args:
        input_shape: Sequence of one int: (sequence_length,).
        vocabulary_size: Int. Number of token ids (`max_tokens`).
        width: Int. Model width; must be divisible by `heads`.
        heads: Int. Attention heads.
        feed_forward: Int. Hidden units of the feed-forward network.
        num_classes: Int. Number of classes.

    Returns:
        Uncompiled `keras.Model` mapping int ids of shape (batch, sequence_length)
        to class probabilities of shape (batch, num_classes).
    """
    (sequence_length,) = tuple(input_shape)
    ids = keras.Input(shape=(sequence_length,), dtype="int64")
    x = TokenAndPositionEmbedding(sequence_length, vocabulary_size, width)(ids)
    attention = keras.layers.MultiHeadAttention(heads, width // heads, dropout=0.1)(
        x, x
    )
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x + attention)
    hidden = keras.layers.Dense(feed_forward, activation="relu")(x)
    hidden = keras.layers.Dense(width)(hidden)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x + hidden)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dropout(0.1)(x)
    x = keras.layers.Dense(num_classes)(x)
    outputs = keras.layers.Softmax()(x)
    return keras.Model(ids, outputs, name="text_transformer")


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Runs the job; returns the test accuracy (float in [0, 1])."""
    args = parse_args(argv)
    return example_utils.train_and_evaluate(
        args,
        lambda: load_imdb(
            args.batch_size, args.max_tokens, args.sequence_length, args.seed,
            args.data_dir,
        ),
        lambda shape: build_transformer(shape, vocabulary_size=args.max_tokens),
        learning_rate=3e-4,
    )


if __name__ == "__main__":
    main()
