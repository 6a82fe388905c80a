"""Real models, written as keras.io writes them: a Vision Transformer, a miniature GPT, a timeseries CNN.

* ``vit``: keras.io "Image classification with Vision Transformer" (a `Patches`
  layer, a `PatchEncoder` with a Dense projection plus a position Embedding,
  pre-norm blocks of LayerNormalization, MultiHeadAttention and a Dense+GELU+Dropout
  MLP, then LayerNormalization, Flatten, Dropout, an MLP head and logits). The
  example's data augmentation is left out: the suite measures the training step.
* ``decoder``: keras.io "Text generation with a miniature GPT"
  (`TokenAndPositionEmbedding`, a custom `TransformerBlock` with causal
  MultiHeadAttention, a Dense FFN, LayerNormalization and Dropout; the model
  outputs ``[logits, x]`` and is compiled with
  ``loss=[SparseCategoricalCrossentropy(from_logits=True), None]``).
* ``timeseries``: keras.io "Timeseries classification from scratch" (three
  Conv1D(64, 3, padding="same") + BatchNormalization + ReLU blocks,
  GlobalAveragePooling1D, a softmax Dense; ``sparse_categorical_crossentropy``
  on the probabilities).

The layers keep the examples' structure and names; sizes are arguments
(`benchmarks.workloads.workloads` picks them).
"""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np
from keras import layers, ops

from benchmarks.workloads import DISTINCT_BATCHES, Workload, image_inputs, sparse_labels


def mlp(x, hidden_units: Sequence[int], dropout_rate: float):
    """Dense + GELU + Dropout per width (the ViT example's ``mlp``)."""
    for units in hidden_units:
        x = layers.Dense(units, activation=keras.activations.gelu)(x)
        x = layers.Dropout(dropout_rate)(x)
    return x


class Patches(layers.Layer):
    """Square patches of an image batch, flattened: (batch, patches, patch_size**2 * channels)."""

    def __init__(self, patch_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        input_shape = ops.shape(images)
        batch_size, height, width, channels = (input_shape[0], input_shape[1], input_shape[2],
                                               input_shape[3])
        num_patches_h = height // self.patch_size
        num_patches_w = width // self.patch_size
        patches = keras.ops.image.extract_patches(images, size=self.patch_size)
        return ops.reshape(
            patches,
            (batch_size, num_patches_h * num_patches_w, self.patch_size * self.patch_size * channels),
        )

    def get_config(self) -> dict:
        return {**super().get_config(), "patch_size": self.patch_size}


class PatchEncoder(layers.Layer):
    """Dense projection of each patch plus a learned embedding of its position."""

    def __init__(self, num_patches: int, projection_dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)

    def call(self, patch):
        positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
        projected_patches = self.projection(patch)
        return projected_patches + self.position_embedding(positions)


def vit(
    image_size: int, patch_size: int, projection_dim: int, num_heads: int, transformer_layers: int,
    mlp_head_units: Sequence[int], classes: int, batch_size: int,
) -> Workload:
    """The keras.io Vision Transformer classifier (logits out).

    Args:
        image_size: Int. Height and width of the RGB input images.
        patch_size: Int. Side of a square patch.
        projection_dim: Int. Patch embedding width (MultiHeadAttention's key_dim too,
            as in the example).
        num_heads: Int. Attention heads.
        transformer_layers: Int. Encoder blocks.
        mlp_head_units: Sequence of ints. Widths of the head's Dense+GELU layers.
        classes: Int. Output logits.
        batch_size: Int. Samples per step.

    Returns:
        `Workload` named ``"vit"``.
    """
    num_patches = (image_size // patch_size) ** 2
    transformer_units = [projection_dim * 2, projection_dim]

    def build() -> keras.Model:
        inputs = keras.Input(shape=(image_size, image_size, 3))
        patches = Patches(patch_size)(inputs)
        encoded_patches = PatchEncoder(num_patches, projection_dim)(patches)
        for _ in range(transformer_layers):
            x1 = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
            attention_output = layers.MultiHeadAttention(
                num_heads=num_heads, key_dim=projection_dim, dropout=0.1)(x1, x1)
            x2 = layers.Add()([attention_output, encoded_patches])
            x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
            x3 = mlp(x3, hidden_units=transformer_units, dropout_rate=0.1)
            encoded_patches = layers.Add()([x3, x2])
        representation = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
        representation = layers.Flatten()(representation)
        representation = layers.Dropout(0.5)(representation)
        features = mlp(representation, hidden_units=mlp_head_units, dropout_rate=0.5)
        logits = layers.Dense(classes)(features)
        return keras.Model(inputs=inputs, outputs=logits, name="vit")

    inputs = image_inputs(image_size, classes)

    head = "-".join(map(str, mlp_head_units))
    return Workload(
        "vit",
        f"ViT (keras.io) {image_size}x{image_size}x3, patch {patch_size}, d {projection_dim}, "
        f"{num_heads} heads, {transformer_layers} blocks, head {head}, batch {batch_size}",
        batch_size, build, inputs)


def causal_attention_mask(batch_size, n_dest, n_src, dtype):
    """(batch, n_dest, n_src) mask, true where a position may attend (itself and earlier).

    The example tiles a (1, n_dest, n_src) mask to the batch; Keras 3.15's
    ``ops.tile`` cannot take repeats that are a tensor (the symbolic batch size)
    while the functional model is built, so the mask is broadcast instead: same values.
    """
    i = ops.arange(n_dest)[:, None]
    j = ops.arange(n_src)
    m = i >= j - n_src + n_dest
    mask = ops.cast(m, dtype)
    mask = ops.reshape(mask, [1, n_dest, n_src])
    return ops.broadcast_to(mask, (batch_size, n_dest, n_src))


class TransformerBlock(layers.Layer):
    """Causal self-attention and a Dense FFN, each with Dropout, residual and LayerNormalization."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, rate: float = 0.1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads, embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        input_shape = ops.shape(inputs)
        batch_size = input_shape[0]
        seq_len = input_shape[1]
        causal_mask = causal_attention_mask(batch_size, seq_len, seq_len, "bool")
        attention_output = self.att(inputs, inputs, attention_mask=causal_mask)
        attention_output = self.dropout1(attention_output)
        out1 = self.layernorm1(inputs + attention_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    """Token embedding plus a learned embedding of each position."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(0, maxlen, 1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def decoder_loss():
    """The example's compile loss: cross-entropy on the logits, none on the block's output."""
    return [keras.losses.SparseCategoricalCrossentropy(from_logits=True), None]


def decoder(
    maxlen: int, vocab_size: int, embed_dim: int, num_heads: int, feed_forward_dim: int,
    batch_size: int,
) -> Workload:
    """The keras.io miniature GPT: one causal TransformerBlock, outputs ``[logits, x]``.

    Args:
        maxlen: Int. Tokens per sequence.
        vocab_size: Int. Vocabulary size (logits per token).
        embed_dim: Int. Embedding width (MultiHeadAttention's key_dim too).
        num_heads: Int. Attention heads.
        feed_forward_dim: Int. Width of the FFN's hidden Dense layer (ReLU).
        batch_size: Int. Samples per step.

    Returns:
        `Workload` named ``"decoder"``; its labels are the next token of each position.
    """

    def build() -> keras.Model:
        inputs = layers.Input(shape=(maxlen,), dtype="int32")
        x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
        x = TransformerBlock(embed_dim, num_heads, feed_forward_dim)(x)
        outputs = layers.Dense(vocab_size)(x)
        return keras.Model(inputs=inputs, outputs=[outputs, x], name="decoder")

    def inputs(batch: int, rng: np.random.Generator):
        n = batch * DISTINCT_BATCHES
        tokens = sparse_labels(rng, (n, maxlen + 1), vocab_size)
        return tokens[:, :-1], tokens[:, 1:]

    return Workload(
        "decoder",
        f"GPT-style decoder (keras.io) {maxlen} tokens, vocabulary {vocab_size}, d {embed_dim}, "
        f"{num_heads} heads, FFN {feed_forward_dim}, batch {batch_size}",
        batch_size, build, inputs, loss=decoder_loss)


def timeseries(length: int, filters: int, classes: int, batch_size: int) -> Workload:
    """The keras.io fully convolutional timeseries classifier (softmax probabilities out).

    Args:
        length: Int. Time steps of the univariate input series.
        filters: Int. Conv1D filters of each block (the example: 64).
        classes: Int. Output classes.
        batch_size: Int. Samples per step.

    Returns:
        `Workload` named ``"timeseries"``, compiled with the example's loss
        ``"sparse_categorical_crossentropy"`` on the softmax output.
    """

    def build() -> keras.Model:
        input_layer = keras.layers.Input((length, 1))
        x = input_layer
        for _ in range(3):
            x = keras.layers.Conv1D(filters=filters, kernel_size=3, padding="same")(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.ReLU()(x)
        gap = keras.layers.GlobalAveragePooling1D()(x)
        output_layer = keras.layers.Dense(classes, activation="softmax")(gap)
        return keras.models.Model(inputs=input_layer, outputs=output_layer, name="timeseries")

    def inputs(batch: int, rng: np.random.Generator):
        n = batch * DISTINCT_BATCHES
        return rng.standard_normal((n, length, 1)).astype(np.float32), sparse_labels(rng, (n,), classes)

    return Workload(
        "timeseries",
        f"Conv1D + BatchNormalization timeseries classifier (keras.io) {length} steps, "
        f"3 blocks of {filters} filters, {classes} classes, batch {batch_size}",
        batch_size, build, inputs, loss=lambda: "sparse_categorical_crossentropy")
