"""Train under mixed precision, then ship float32: SavedModel and TFLite, checked.

Trains the digits CNN of `train_digits.py` under `tfmp.enable()`, then writes a
SavedModel, a TFLite file and a TFLite file with float16 weights from the model's
float32 copy (`tfmp.export`), each run on test images and compared with the
trained model, and a ``.keras`` file of the float32 copy that plain Keras loads
without tfmp.

    python examples/export_model.py                          # policy "auto"
    python examples/export_model.py --policy mixed_bfloat16 --out-dir exported
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional, Sequence

import example_args  # examples/, next to this file; imports no TensorFlow


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train the digits CNN with tfmp mixed precision, then export "
        "its float32 copy as a SavedModel and a TFLite file and compare them with "
        "the trained model."
    )
    example_args.add_training_args(parser, epochs=5, batch_size=64,
                                   log_dir=os.path.join("logs", "export"))
    parser.add_argument("--out-dir", default="exported",
                        help="folder for the artifacts (default exported)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and usage errors answer here, before TensorFlow loads
    example_args.require("sklearn", example_args.DIGITS_DATA)  # and a missing scikit-learn

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmp  # noqa: E402

import example_utils  # noqa: E402  (examples/, next to this file)
import train_digits  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> List:
    """Runs the job; returns the three `tfmp.export` reports (SavedModel, TFLite, TFLite fp16)."""
    args = parse_args(argv)
    trained = {}

    def build(input_shape):
        trained["model"] = train_digits.build_model(input_shape)
        return trained["model"]

    example_utils.train_and_evaluate(
        args, lambda: train_digits.make_datasets("digits", args.batch_size, args.seed), build
    )
    model = trained["model"]
    _, (x_test, _) = train_digits.load_digits_arrays(seed=args.seed)
    sample = x_test[:64]
    os.makedirs(args.out_dir, exist_ok=True)
    reports = [
        tfmp.export(model, os.path.join(args.out_dir, "saved_model"), sample=sample),
        tfmp.export(model, os.path.join(args.out_dir, "digits.tflite"), format="tflite",
                    sample=sample),
        tfmp.export(model, os.path.join(args.out_dir, "digits_fp16.tflite"), format="tflite",
                    weights="float16", sample=sample),
    ]
    for report in reports:
        print(report)
    keras_path = os.path.join(args.out_dir, "digits_float32.keras")
    tfmp.to_float32(model).save(keras_path)
    print(f"Float32 Keras file: {keras_path} (keras.models.load_model(path, compile=False), "
          "no tfmp needed)")
    return reports


if __name__ == "__main__":
    main()
