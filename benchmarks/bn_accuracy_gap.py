"""Is an early accuracy gap bfloat16 or BatchNormalization's moving statistics?

The case: the digits CNN of examples/train_digits.py (Conv2D, BatchNormalization,
Dense), 1,347 training and 450 validation images, Adam(1e-3), 8 epochs, batch 32
(``--batch-size``),
float32 against mixed_bfloat16. For each seed, policy and model (with and without
the BatchNormalization layer) this trains once and measures:

* ``train``: training accuracy of the last epoch (as `fit` reports it);
* ``val_moving``: validation accuracy with BatchNormalization in inference mode,
  i.e. its moving mean and variance (what `fit`'s ``val_accuracy`` reports);
* ``val_recomputed``: validation accuracy after replacing the moving statistics
  by the mean and variance of the layer's input over the whole training set,
  computed with the final weights (the population statistics the moving averages
  estimate; BatchNormalization's momentum of 0.99 makes them lag after few steps).

If the float32/bfloat16 gap of ``val_moving`` closes in ``val_recomputed`` and in
the model without BatchNormalization, the gap is the moving statistics, not the
arithmetic.

    python benchmarks/bn_accuracy_gap.py --seeds 0 1 2 3 4 --json gap.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tfmp
sys.path.insert(0, str(ROOT / "examples"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from train_digits import load_digits_arrays  # noqa: E402

import tfmp  # noqa: E402

POLICIES = ("float32", "mixed_bfloat16")


def build(batch_norm: bool) -> keras.Model:
    """The digits CNN of examples/train_digits.py, optionally without its BN layer."""
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    if batch_norm:
        x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(128, activation="relu")(x)
    x = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, keras.layers.Softmax()(x))
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def recomputed_accuracy(model: keras.Model, x_train, x_val, y_val) -> float:
    """Validation accuracy with BN statistics recomputed over the training set."""
    bn = model.get_layer("bn")
    features = keras.Model(model.inputs, bn.input).predict(x_train, batch_size=450,
                                                           verbose=0)
    features = np.asarray(features, dtype="float64").reshape(-1, features.shape[-1])
    saved = [bn.moving_mean.numpy(), bn.moving_variance.numpy()]
    bn.moving_mean.assign(features.mean(axis=0).astype("float32"))
    bn.moving_variance.assign(features.var(axis=0).astype("float32"))
    _, accuracy = model.evaluate(x_val, y_val, batch_size=450, verbose=0)
    bn.moving_mean.assign(saved[0])
    bn.moving_variance.assign(saved[1])
    return float(accuracy)


def run(seed: int, policy: str, batch_norm: bool, epochs: int, batch_size: int,
        data) -> Dict[str, float]:
    (x, y), (x_val, y_val) = data
    with tfmp.policy_scope(policy):
        keras.utils.set_random_seed(seed)
        model = build(batch_norm)
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=True, verbose=0,
                            validation_data=(x_val, y_val))
    out = {"train": history.history["accuracy"][-1],
           "val_moving": history.history["val_accuracy"][-1]}
    if batch_norm:
        out["val_recomputed"] = recomputed_accuracy(model, x, x_val, y_val)
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    data = load_digits_arrays(test_fraction=0.25)
    results = []
    for seed in args.seeds:
        for batch_norm in (True, False):
            for policy in POLICIES:
                row = dict(seed=seed, policy=policy, batch_norm=batch_norm,
                           **run(seed, policy, batch_norm, args.epochs,
                                  args.batch_size, data))
                print(json.dumps(row), flush=True)
                results.append(row)
    summary = {}
    for batch_norm in (True, False):
        for key in ("train", "val_moving", "val_recomputed"):
            gaps = [100 * (b[key] - a[key]) for a, b in zip(
                [r for r in results if r["batch_norm"] == batch_norm and r["policy"] == POLICIES[0]],
                [r for r in results if r["batch_norm"] == batch_norm and r["policy"] == POLICIES[1]])
                if key in a]
            if gaps:
                name = f"{'bn' if batch_norm else 'no_bn'}/{key}"
                summary[name] = {"gaps_pp": gaps, "mean_pp": float(np.mean(gaps))}
                print(name, " ".join(f"{g:+.2f}" for g in gaps), f"mean {np.mean(gaps):+.2f} pp")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return summary


if __name__ == "__main__":
    main()
