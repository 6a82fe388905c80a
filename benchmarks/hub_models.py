"""keras-hub's own models, built from a configuration (no preset, no download), when keras-hub is installed.

* ``gpt2``: ``keras_hub.models.GPT2CausalLM`` (a causal language model: the
  logits are the token embedding, transposed), ``preprocessor=None``;
* ``bart``: ``keras_hub.models.BartSeq2SeqLM`` (an encoder-decoder), ``preprocessor=None``.

Both train on next-token labels with the task's own default loss,
``SparseCategoricalCrossentropy(from_logits=True)``, as ``Task.compile`` picks it.
"""

from __future__ import annotations

from typing import Callable, Dict

import keras
import numpy as np

from benchmarks.workloads import DISTINCT_BATCHES, Workload, sparse_labels


def available() -> bool:
    """True when keras-hub imports (it is not among tfmp's dependencies)."""
    try:
        import keras_hub  # noqa: F401
    except ImportError:
        return False
    return True


def _tokens(rng: np.random.Generator, n: int, length: int, vocab: int) -> Dict[str, np.ndarray]:
    ids = sparse_labels(rng, (n, length + 1), vocab)
    return {"ids": ids[:, :-1], "next": ids[:, 1:], "mask": np.ones((n, length), dtype=bool)}


def _lm_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def task_builder(backbone: str, task: str, vocab: int, layers: int, heads: int, hidden: int,
                 length: int, **options) -> Callable[[], keras.Model]:
    """`Workload.build` of keras-hub's ``task`` on a ``backbone`` of that size (feed-forward 4x wide);
    `options` go to the backbone too (e.g. ``dropout=0.0``)."""

    def build() -> keras.Model:
        import keras_hub

        made = getattr(keras_hub.models, backbone)(
            vocabulary_size=vocab, num_layers=layers, num_heads=heads, hidden_dim=hidden,
            intermediate_dim=4 * hidden, max_sequence_length=length, **options)
        return getattr(keras_hub.models, task)(backbone=made, preprocessor=None)

    return build


def gpt2(vocab: int, layers: int, heads: int, hidden: int, length: int, batch_size: int) -> Workload:
    """keras-hub's GPT-2 causal LM at the given size.

    Args:
        vocab: Int. Vocabulary size (logits per token).
        layers: Int. Decoder blocks.
        heads: Int. Attention heads.
        hidden: Int. Model width; the feed-forward width is 4x, as in GPT-2.
        length: Int. Tokens per sequence.
        batch_size: Int. Sequences per step.

    Returns:
        `Workload` named ``"gpt2"``; inputs ``{"token_ids", "padding_mask"}``, labels the next tokens.
    """

    build = task_builder("GPT2Backbone", "GPT2CausalLM", vocab, layers, heads, hidden, length)

    def inputs(batch: int, rng: np.random.Generator):
        t = _tokens(rng, batch * DISTINCT_BATCHES, length, vocab)
        return {"token_ids": t["ids"], "padding_mask": t["mask"]}, t["next"]

    return Workload(
        "gpt2",
        f"keras-hub GPT2CausalLM {layers} blocks, d {hidden}, {heads} heads, vocabulary {vocab}, "
        f"{length} tokens, batch {batch_size}",
        batch_size, build, inputs, loss=_lm_loss)


def bart(vocab: int, layers: int, heads: int, hidden: int, length: int, batch_size: int) -> Workload:
    """keras-hub's BART encoder-decoder LM at the given size.

    Args:
        vocab: Int. Vocabulary size (logits per token).
        layers: Int. Encoder blocks, and as many decoder blocks.
        heads: Int. Attention heads.
        hidden: Int. Model width; the feed-forward width is 4x.
        length: Int. Tokens per sequence, encoder and decoder alike.
        batch_size: Int. Sequence pairs per step.

    Returns:
        `Workload` named ``"bart"``; inputs the encoder and decoder token ids and
        padding masks, labels the decoder's next tokens.
    """

    build = task_builder("BartBackbone", "BartSeq2SeqLM", vocab, layers, heads, hidden, length)

    def inputs(batch: int, rng: np.random.Generator):
        n = batch * DISTINCT_BATCHES
        source, target = _tokens(rng, n, length, vocab), _tokens(rng, n, length, vocab)
        x = {"encoder_token_ids": source["ids"], "encoder_padding_mask": source["mask"],
             "decoder_token_ids": target["ids"], "decoder_padding_mask": target["mask"]}
        return x, target["next"]

    return Workload(
        "bart",
        f"keras-hub BartSeq2SeqLM {layers}+{layers} blocks, d {hidden}, {heads} heads, vocabulary {vocab}, "
        f"{length} tokens, batch {batch_size}",
        batch_size, build, inputs, loss=_lm_loss)
