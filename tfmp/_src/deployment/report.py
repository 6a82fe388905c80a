"""`ExportReport`: what `tfmp.export` wrote and how close it is to the trained model."""

from __future__ import annotations

import dataclasses
from typing import Tuple

from tfmp._src.report_fields import COUNT, REAL, STRING, check_fields, one_of, tuple_of

FORMATS = ("tf_saved_model", "tflite")
WEIGHTS = ("float32", "float16")


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """The result of `tfmp.export`.

    Attributes:
        path: String. The SavedModel folder or the TFLite file written.
        format: String. ``"tf_saved_model"`` or ``"tflite"``.
        weights: String. ``"float32"`` or ``"float16"`` (stored weight dtype).
        max_abs_diff: Float. Largest absolute difference, over every output element
            of the sample batch, between the artifact and the trained model.
        max_rel_diff: Float. Largest, over outputs, of the output's largest absolute
            difference over the trained output's largest magnitude (scale-free).
        output_shapes: Tuple of int tuples. Shape of each artifact output, in the
            model's output order.
        output_dtypes: Tuple of strings. Dtype of each artifact output.
        size_bytes: Int. Bytes on disk (the whole folder for a SavedModel).
        sample_rows: Int. Rows of the sample batch compared.

    Raises:
        ValueError: (template) a field of the wrong type: a format or weights
            dtype not named above, sizes that are not integers >= 0, differences
            that are not numbers.
    """

    path: str
    format: str
    weights: str
    max_abs_diff: float
    max_rel_diff: float
    output_shapes: Tuple[Tuple[int, ...], ...]
    output_dtypes: Tuple[str, ...]
    size_bytes: int
    sample_rows: int

    def __post_init__(self) -> None:
        check_fields(
            self, path=STRING, format=one_of(*FORMATS),
            weights=one_of(*WEIGHTS), max_abs_diff=REAL, max_rel_diff=REAL,
            output_shapes=tuple_of(tuple_of(COUNT)), output_dtypes=tuple_of(STRING),
            size_bytes=COUNT, sample_rows=COUNT,
        )

    def __str__(self) -> str:
        outputs = ", ".join(
            f"{shape} {dtype}" for shape, dtype in zip(self.output_shapes, self.output_dtypes)
        )
        return (
            f"tfmp export: {self.format} ({self.weights} weights) at {self.path}, "
            f"{self.size_bytes / 1024:.1f} KiB\n"
            f"  outputs: {outputs}\n"
            f"  against the trained model on {self.sample_rows} sample rows: "
            f"max abs diff {self.max_abs_diff:.3g}, max rel diff {self.max_rel_diff:.3g}"
        )
