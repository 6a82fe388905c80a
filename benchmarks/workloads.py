"""The models the suite trains and their in-memory input pipelines.

Six workloads, each with a full size (the one the targets of issues 9 and 27
refer to) and a tiny "quick" size that only checks the suite still runs:

| name        | full size                                                         |
|-------------|-------------------------------------------------------------------|
| mlp         | Dense 1024-2048-2048-2048-10, batch 256, Adam                     |
| cnn         | 4 Conv2D 64-64-128-128 + BatchNormalization, 32x32x3, batch 128   |
| transformer | 2 encoder blocks, d_model 128, 4 heads, FFN 512, 128 tokens, batch 64 |
| resnet50    | `keras.applications.ResNet50`, no weights, 64x64x3, 10 classes, batch 32 (full size only) |
| vit         | keras.io ViT, 32x32x3, patch 4, d 64, 4 heads, 4 blocks, head 2048-1024, batch 64 |
| decoder     | keras.io miniature GPT, 80 tokens, vocabulary 2000, d 128, 2 heads, FFN 128, batch 32 |

The ViT and the decoder are written as keras.io writes them
(`benchmarks.real_models`); the decoder has two outputs, ``[logits, x]``, and a
loss on the logits only (`Workload.loss`).

Inputs are synthetic (fixed seed): the suite measures speed, not accuracy, and
needs no download. A few distinct batches are cached in memory and repeated, so
the input pipeline costs next to nothing and every configuration sees the same
data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

# Distinct batches held in memory; the dataset repeats them.
DISTINCT_BATCHES = 4


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model to benchmark.

    Attributes:
        name: String. Short name used in tables and JSON (``"mlp"``...).
        description: String. What the model is, for the report.
        batch_size: Int. Samples per training step.
        build: Callable returning an unbuilt-optimizer, uncompiled `keras.Model`
            under the global dtype policy in force when it is called.
        inputs: Callable ``(batch_size, rng) -> (x, y)`` of NumPy arrays holding
            `DISTINCT_BATCHES` batches.
        loss: Callable returning `compile`'s ``loss``, or None: sparse
            categorical cross-entropy on logits (see `compile_loss`).
    """

    name: str
    description: str
    batch_size: int
    build: Callable[[], keras.Model]
    inputs: Callable[[int, np.random.Generator], Tuple[np.ndarray, np.ndarray]]
    loss: Optional[Callable[[], Any]] = None

    def compile_loss(self) -> Any:
        """A new ``loss`` for `compile`: the workload's own, else cross-entropy on logits."""
        if self.loss is not None:
            return self.loss()
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset(self, seed: int = 0) -> tf.data.Dataset:
        """Cached, repeated, prefetched batches of synthetic data.

        Args:
            seed: Int. Seed of the NumPy generator.

        Returns:
            `tf.data.Dataset` of ``(x, y)`` batches of `batch_size`, infinite.
        """
        x, y = self.inputs(self.batch_size, np.random.default_rng(seed))
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .batch(self.batch_size, drop_remainder=True)
            .cache()
            .repeat()
            .prefetch(tf.data.AUTOTUNE)
        )


def sparse_labels(rng: np.random.Generator, shape: Tuple[int, ...], classes: int) -> np.ndarray:
    """Int32 class ids in [0, classes) of `shape` (labels, or token ids)."""
    return rng.integers(0, classes, size=shape, dtype=np.int32)


def image_inputs(size: int, classes: int) -> Callable[[int, np.random.Generator], Tuple[np.ndarray, np.ndarray]]:
    """A `Workload.inputs` for an image classifier.

    Returns:
        Callable ``(batch, rng) -> (images, labels)``: `DISTINCT_BATCHES` batches of
        float32 images uniform in [0, 1) of shape ``(size, size, 3)``, and int32
        class ids in [0, classes).
    """

    def inputs(batch: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
        n = batch * DISTINCT_BATCHES
        images = rng.uniform(0.0, 1.0, (n, size, size, 3)).astype(np.float32)
        return images, sparse_labels(rng, (n,), classes)

    return inputs


def mlp(features: int, hidden: int, depth: int, classes: int, batch_size: int) -> Workload:
    """A multi-layer perceptron on dense float features.

    Args:
        features: Int. Input width.
        hidden: Int. Width of each hidden Dense layer (ReLU).
        depth: Int. Number of hidden layers.
        classes: Int. Output logits.
        batch_size: Int. Samples per step.

    Returns:
        `Workload` named ``"mlp"``.
    """

    def build() -> keras.Model:
        x = inputs = keras.Input((features,))
        for _ in range(depth):
            x = keras.layers.Dense(hidden, activation="relu")(x)
        return keras.Model(inputs, keras.layers.Dense(classes)(x), name="mlp")

    def inputs(batch: int, rng: np.random.Generator):
        n = batch * DISTINCT_BATCHES
        return rng.standard_normal((n, features), dtype=np.float32), sparse_labels(rng, (n,), classes)

    widths = "-".join([str(features)] + [str(hidden)] * depth + [str(classes)])
    return Workload("mlp", f"MLP {widths}, batch {batch_size}", batch_size, build, inputs)


def cnn(
    size: int, filters: Tuple[int, ...], classes: int, batch_size: int, batch_norm: bool = True,
) -> Workload:
    """A small VGG-style CNN: Conv2D + BatchNormalization + ReLU blocks.

    Args:
        size: Int. Height and width of the RGB input images.
        filters: Tuple of ints. Filters of each 3x3 Conv2D; a 2x2 max-pool
            follows every second one.
        classes: Int. Output logits.
        batch_size: Int. Samples per step.
        batch_norm: Bool. False leaves the BatchNormalization layers out
            (Conv2D + ReLU blocks), to see what they cost.

    Returns:
        `Workload` named ``"cnn"``.
    """

    def build() -> keras.Model:
        x = inputs = keras.Input((size, size, 3))
        for i, width in enumerate(filters):
            x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
            if batch_norm:
                x = keras.layers.BatchNormalization()(x)
            x = keras.layers.ReLU()(x)
            if i % 2 == 1:
                x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(classes)(x), name="cnn")

    inputs = image_inputs(size, classes)

    widths = "-".join(map(str, filters))
    return Workload(
        "cnn",
        f"CNN conv {widths} {'+' if batch_norm else 'without'} BatchNorm, {size}x{size}x3, "
        f"batch {batch_size}",
        batch_size,
        build,
        inputs,
    )


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a (batch, seq, width) input."""

    def build(self, input_shape: Tuple[int, ...]) -> None:
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]), initializer="random_normal", name="positions"
        )

    def call(self, x):
        return x + self.positions


def transformer(
    seq_len: int, vocab: int, d_model: int, heads: int, ffn: int, blocks: int,
    classes: int, batch_size: int,
) -> Workload:
    """A small Transformer encoder classifier (post-norm blocks, learned positions).

    Args:
        seq_len: Int. Tokens per sequence.
        vocab: Int. Vocabulary size.
        d_model: Int. Embedding width.
        heads: Int. Attention heads (key dim ``d_model // heads``).
        ffn: Int. Width of the feed-forward hidden layer (GELU).
        blocks: Int. Encoder blocks.
        classes: Int. Output logits (mean-pooled sequence).
        batch_size: Int. Samples per step.

    Returns:
        `Workload` named ``"transformer"``.
    """

    def build() -> keras.Model:
        tokens = keras.Input((seq_len,), dtype="int32")
        x = PositionEmbedding()(keras.layers.Embedding(vocab, d_model)(tokens))
        for _ in range(blocks):
            attention = keras.layers.MultiHeadAttention(heads, d_model // heads)(x, x)
            x = keras.layers.LayerNormalization()(x + attention)
            hidden = keras.layers.Dense(ffn, activation="gelu")(x)
            x = keras.layers.LayerNormalization()(x + keras.layers.Dense(d_model)(hidden))
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(tokens, keras.layers.Dense(classes)(x), name="transformer")

    def inputs(batch: int, rng: np.random.Generator):
        n = batch * DISTINCT_BATCHES
        ids = rng.integers(0, vocab, size=(n, seq_len), dtype=np.int32)
        return ids, sparse_labels(rng, (n,), classes)

    return Workload(
        "transformer",
        f"Transformer encoder {blocks}x(d {d_model}, {heads} heads, FFN {ffn}), "
        f"{seq_len} tokens, batch {batch_size}",
        batch_size,
        build,
        inputs,
    )


def resnet50(size: int, classes: int, batch_size: int) -> Workload:
    """`keras.applications.ResNet50` (random weights, logits out): 53 BatchNormalization layers.

    Args:
        size: Int. Height and width of the RGB input images.
        classes: Int. Output logits.
        batch_size: Int. Samples per step.

    Returns:
        `Workload` named ``"resnet50"``.
    """

    def build() -> keras.Model:
        return keras.applications.ResNet50(
            weights=None, input_shape=(size, size, 3), classes=classes, classifier_activation=None)

    inputs = image_inputs(size, classes)

    return Workload("resnet50", f"ResNet50 {size}x{size}x3, batch {batch_size}", batch_size,
                    build, inputs)


def workloads(quick: bool = False, batch_norm: bool = True) -> Dict[str, Workload]:
    """The suite's workloads by name, at full or quick size.

    Args:
        quick: Bool. Tiny sizes that train in milliseconds (for tests).
        batch_norm: Bool. False: the CNN without its BatchNormalization layers.

    Returns:
        Dict mapping ``"mlp"``, ``"cnn"``, ``"transformer"``, ``"vit"``,
        ``"decoder"`` and, at full size only, ``"resnet50"``, ``"timeseries"``
        and, where keras-hub is installed, ``"gpt2"`` and ``"bart"`` to `Workload`.
    """
    from benchmarks import hub_models, real_models  # they build on this module's Workload

    if quick:
        chosen = (
            mlp(32, 32, 3, 10, batch_size=16),
            cnn(8, (4, 4, 8, 8), 10, batch_size=8, batch_norm=batch_norm),
            transformer(8, 50, 16, 2, 32, 1, 2, batch_size=8),
            real_models.vit(8, 4, 8, 2, 1, (16, 8), 10, batch_size=8),
            real_models.decoder(8, 50, 16, 2, 16, batch_size=8),
        )
    else:
        chosen = (
            mlp(1024, 2048, 3, 10, batch_size=256),
            cnn(32, (64, 64, 128, 128), 10, batch_size=128, batch_norm=batch_norm),
            transformer(128, 2000, 128, 4, 512, 2, 2, batch_size=64),
            resnet50(64, 10, batch_size=32),
            real_models.vit(32, 4, 64, 4, 4, (2048, 1024), 10, batch_size=64),
            real_models.decoder(80, 2000, 128, 2, 128, batch_size=32),
            real_models.timeseries(500, 64, 2, batch_size=32),
        )
        if hub_models.available():
            chosen += (hub_models.gpt2(8000, 2, 4, 256, 128, batch_size=8),
                       hub_models.bart(8000, 2, 4, 256, 64, batch_size=8))
    return {w.name: w for w in chosen}
