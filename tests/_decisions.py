"""Writes what tfmp decides in a fresh process, as JSON to ``--out`` (tests/test_reproducible.py).

Under "auto" and ``mixed_float16``: the policy and its reason, and the attachment of
a small model with a GELU Dense, a Conv2D and BatchNormalization (every field of its `tfmp.Attachment`). Any timing probe that runs fails the process: nothing tfmp decides may
rest on one.
"""

import argparse
import dataclasses
import json
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import tfmp  # noqa: E402
from tfmp._src.float32 import gelu  # noqa: E402
from tfmp._src.policy import float16_fusion, speed_probe  # noqa: E402


def _no_timing(*args, **kwargs):
    raise AssertionError("a timing probe ran while tfmp decided")


def decided(policy: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)
        with tfmp.policy_scope(policy) as decision:
            inputs = keras.Input((8, 8, 1))
            x = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.Dense(16, activation="gelu")(keras.layers.Flatten()(x))
            model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))
            model.compile("adam", "sparse_categorical_crossentropy")
    # Every field of the attachment: each per-model decision (remapper, GELU, bias
    # gradients, convolutions, BatchNormalization kernel, speedups, optimizer...).
    return {"policy": decision.policy, "reason": decision.reason,
            "attachment": dataclasses.asdict(tfmp.attachment(model)),
            "optimizer": type(model.optimizer).__name__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    for module, name in ((speed_probe, "_measure"), (float16_fusion, "measure"), (gelu, "measure")):
        setattr(module, name, _no_timing)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({policy: decided(policy) for policy in ("auto", "mixed_float16")}, f)


if __name__ == "__main__":
    main()
