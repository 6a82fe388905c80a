"""A tied output embedding under mixed_bfloat16: which part needs float32, and what it costs.

A language model's ``keras.layers.ReversibleEmbedding`` is looked up at the input
(``embedding(ids)``) and, with the same matrix, projects the last hidden state to
the vocabulary (``embedding(h, reverse=True)``), usually the widest matmul of the
model. Four ways to run it, the body between them (one ``Dense``) in bfloat16:

* ``float32``: the whole model in float32 (reference);
* ``forced whole``: the layer's policy set to float32: lookup and projection in
  float32, the lookup handed to the body in float32 (what tfmp did to it before);
* ``keras``: the layer in ``mixed_bfloat16``, as plain Keras runs it and as tfmp
  leaves it under a from-logits cross-entropy (`tfmp._src.float32.logits`): the
  lookup in bfloat16; the projection in float32 all the same, since
  ``Embedding`` sets ``autocast=False`` and, inside a model, its float32 table
  meets the bfloat16 hidden state and ``ops.matmul`` promotes both to float32;
* ``reverse_dtype bfloat16``: ``reverse_dtype="bfloat16"`` on the layer (what
  `tfmp.audit` advises): the projection a bfloat16 matmul, its logits cast to
  float32 (as tfmp casts them).

Reported: the time of one forward + backward step (``SparseCategoricalCrossentropy
(from_logits=True)``, gradients of every variable), variants alternated, median
of the repeats; and each variant's loss and embedding gradient against the
``float32`` model with the same weights (relative error of the loss, of the
gradient's norm-2 difference), with Keras's initial embedding (uniform in
+-0.05: logits near 0) and with it scaled by 40 (logits spread over units, as in
a trained model; the standard deviation of the float32 logits is printed).

    python benchmarks/tied_logits.py
    python benchmarks/tied_logits.py --quick     # tiny sizes: checks it runs
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import tensorflow as tf
import keras

VARIANTS = ("float32", "forced whole", "keras", "reverse_dtype bfloat16")


def build(variant: str, vocab: int, dim: int, seq: int) -> keras.Model:
    """The model for one variant (ids -> lookup -> Dense -> tied projection -> float32 logits)."""
    body = "float32" if variant == "float32" else "mixed_bfloat16"
    embedding_dtype = "float32" if variant == "forced whole" else body
    reverse_dtype = "bfloat16" if variant == "reverse_dtype bfloat16" else None
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(body)  # the model's own policy: a mixed model opens an autocast scope
    try:
        embedding = keras.layers.ReversibleEmbedding(vocab, dim, dtype=embedding_dtype,
                                                     reverse_dtype=reverse_dtype, name="embedding")
        ids = keras.Input((seq,), dtype="int32")
        hidden = keras.layers.Dense(dim, activation="relu", name="body")(embedding(ids))
        logits = keras.ops.cast(embedding(hidden, reverse=True), "float32")
        return keras.Model(ids, logits)
    finally:
        keras.config.set_dtype_policy(before)


def step_function(model: keras.Model):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(ids, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(ids, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    return step


def main(argv) -> None:
    quick = "--quick" in argv
    vocab, dim, batch, seq, repeats = (500, 32, 2, 16, 3) if quick else (32000, 256, 8, 128, 15)
    rng = np.random.default_rng(0)
    ids = tf.constant(rng.integers(0, vocab, (batch, seq)), "int32")
    labels = tf.constant(rng.integers(0, vocab, (batch, seq)), "int32")
    models = {v: build(v, vocab, dim, seq) for v in VARIANTS}
    for model in models.values():
        model.set_weights(models["float32"].get_weights())
    steps = {v: step_function(m) for v, m in models.items()}
    initial = models["float32"].get_weights()
    accuracy = {}
    for scale in (1.0, 40.0):
        for model in models.values():
            model.set_weights([w * scale if i == 0 else w for i, w in enumerate(initial)])
        spread = float(np.std(models["float32"](ids)))
        accuracy[scale] = spread, {v: steps[v](ids, labels) for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for v in VARIANTS:
            start = time.perf_counter()
            loss, grads = steps[v](ids, labels)
            float(loss)
            times[v].append(time.perf_counter() - start)
    print(f"vocabulary {vocab}, hidden {dim}, {batch}x{seq} tokens; {repeats} repeats; "
          f"TensorFlow {tf.__version__}, Keras {keras.__version__}")
    base = statistics.median(times["float32"])
    print(f"{'variant':<20} {'step ms':>8} {'vs float32':>10}")
    for v in VARIANTS:
        median = statistics.median(times[v])
        print(f"{v:<20} {median * 1e3:8.2f} {median / base:10.2f}")
    for scale, (spread, results) in accuracy.items():
        ref_loss, ref_grads = results["float32"]
        print(f"embedding x{scale:g} (float32 logits std {spread:.3g}): "
              f"{'loss rel err':>13} {'emb grad rel err':>17}")
        for v in VARIANTS[1:]:
            loss, grads = results[v]
            g, r = (np.asarray(tf.cast(x, tf.float64)) for x in (grads[0], ref_grads[0]))
            loss_err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
            grad_err = np.linalg.norm(g - r) / np.linalg.norm(r)
            print(f"  {v:<20} {loss_err:13.2e} {grad_err:17.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
