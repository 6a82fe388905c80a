"""`tfmp.check_dataset`: find NaN, Inf and values the compute dtype cannot hold, before training.

Dirty data is a common cause of a NaN loss and looks like a numerical failure of the model.
This preflight scans batches on the host with NumPy and names the batch, the feature and
the count. Limits come from `ml_dtypes.finfo` (float16: IEEE 754 binary16).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterable, Iterator, Optional, Union

import keras
import ml_dtypes
import numpy as np
import tensorflow as tf

from tfmp._src.errors import check_positive_int, invalid_argument, warn
from tfmp._src.report_fields import COUNT, REAL, STRING, check_fields, instance_of, list_of

_COMPONENTS = ("x", "y", "sample_weight")
_PROBLEMS = {
    "nan": "NaN",
    "inf": "Inf",
    "overflow": "above the dtype's largest finite value",
    "underflow": "nonzero but below the dtype's smallest subnormal",
}
_POLICIES = ("float16", "bfloat16", "float32", "float64", "mixed_float16", "mixed_bfloat16")
_SHOWN = 20


@dataclasses.dataclass(frozen=True)
class DatasetIssue:
    """One kind of bad value in one feature of one batch.

    Attributes:
        batch: Int. Zero-based index of the batch in iteration order.
        component: String. `"x"`, `"y"` or `"sample_weight"`, with the key path of nested inputs (`"x/age"`).
        feature: Int or None. Index along the component's last axis; None for a component of rank <= 1.
        problem: String. `"nan"`, `"inf"`, `"overflow"` or `"underflow"`.
        count: Int. How many values of this feature in this batch have the problem.
    """

    batch: int
    component: str
    feature: Optional[int]
    problem: str
    count: int

    def __str__(self) -> str:
        where = self.component if self.feature is None else f"{self.component} feature {self.feature}"
        return f"batch {self.batch}, {where}: {self.count} value(s) {_PROBLEMS[self.problem]}"


@dataclasses.dataclass
class DatasetReport:
    """What `check_dataset` found.

    Attributes:
        compute_dtype: String. The dtype the range checks used, e.g. `"float16"`.
        max_value: Float. Its largest finite value (65504 for float16).
        smallest_subnormal: Float. Its smallest positive value (2**-24 for float16).
        batches_checked: Int. Batches scanned.
        issues: List of `DatasetIssue`, in batch order.
        values_checked: Int. Floating-point values scanned; 0 (and a warning) when
            the data set holds no float component.

    Raises:
        ValueError: (template) `compute_dtype` not a string, a limit not a
            number, `batches_checked` not an integer >= 0, `issues` not a list.
    """

    compute_dtype: str
    max_value: float
    smallest_subnormal: float
    batches_checked: int = 0
    issues: list = dataclasses.field(default_factory=list)
    values_checked: int = 0

    def __post_init__(self) -> None:
        check_fields(self, compute_dtype=STRING, max_value=REAL, smallest_subnormal=REAL,
                     batches_checked=COUNT, issues=list_of(instance_of(DatasetIssue, "a DatasetIssue")),
                     values_checked=COUNT)

    @property
    def ok(self) -> bool:
        """Bool. True when no issue was found."""
        return not self.issues

    def __str__(self) -> str:
        if not self.values_checked:
            return (f"check_dataset: nothing checked in {self.batches_checked} batch(es): no "
                    "floating-point values (only strings or integers).")
        head = (
            f"check_dataset: {len(self.issues)} issue(s) in {self.batches_checked} batch(es) checked "
            f"(compute dtype {self.compute_dtype}: finite up to {self.max_value:.6g}, smallest subnormal "
            f"{self.smallest_subnormal:.3g})."
        )
        lines = [head] + [f"  {issue}" for issue in self.issues[:_SHOWN]]
        if len(self.issues) > _SHOWN:
            lines.append(f"  ... and {len(self.issues) - _SHOWN} more (see report.issues).")
        return "\n".join(lines)


def _compute_dtype(policy: Union[None, str, keras.DTypePolicy]) -> str:
    """The compute dtype of `policy` (the global Keras policy when None)."""
    if policy is None:
        return keras.config.dtype_policy().compute_dtype
    if isinstance(policy, keras.DTypePolicy):
        return policy.compute_dtype
    if isinstance(policy, str) and policy in _POLICIES:
        return keras.DTypePolicy(policy).compute_dtype
    raise invalid_argument(
        "policy", policy, "None, a keras.DTypePolicy or one of " + ", ".join(map(repr, _POLICIES)), choices=_POLICIES,
        fix="Pass e.g. policy='mixed_float16', or None for Keras's global policy.",
    )


#: What `check_dataset` scans, as its messages say it.
_DATASET = ("a tf.data.Dataset, keras.utils.PyDataset, arrays (x or (x, y)) or an iterable of batches, "
            "each an array or tensor of rank >= 1 or a tuple or dict of them")
_MAX_BATCHES_FIX = "Pass the number of batches to scan, e.g. max_batches=100."


def _batches(data: Any, max_batches: Optional[int], batch_size: int) -> Iterator[Any]:
    """Yields batches (nested NumPy-convertible structures) of any supported input."""
    if isinstance(data, tf.data.Dataset):
        if max_batches is None and data.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise invalid_argument("max_batches", max_batches, "an integer >= 1 for an infinite (repeated) dataset",
                                   fix=_MAX_BATCHES_FIX)
        return iter(data.take(-1 if max_batches is None else max_batches).as_numpy_iterator())
    if isinstance(data, keras.utils.PyDataset):
        count = data.num_batches
        if count is None and max_batches is None:
            raise invalid_argument("max_batches", max_batches, "an integer >= 1 for a PyDataset without a length",
                                   fix=_MAX_BATCHES_FIX)
        count = max_batches if count is None else min(count, max_batches or count)
        return _checked_batches(data, (data[index] for index in range(count)))
    if isinstance(data, (str, bytes, bytearray)):
        raise invalid_argument(
            "dataset", data, _DATASET,
            fix="A string is not data: load the file it names first (e.g. with np.load or tf.data).")
    leaves = keras.tree.flatten(data) if isinstance(data, (dict, tuple, np.ndarray, tf.Tensor)) else []
    arrays = [leaf for leaf in leaves if leaf is not None]  # (x, None) as fit takes it
    if arrays and all(isinstance(leaf, (np.ndarray, tf.Tensor)) for leaf in arrays):
        _check_same_length(data)
        size = len(arrays[0])
        starts = range(0, size, batch_size)
        return (keras.tree.map_structure(lambda a, s=s: a if a is None else a[s : s + batch_size], data)
                for s in starts)
    if isinstance(data, Iterable):
        return _checked_batches(data, iter(data))
    raise invalid_argument("dataset", data, _DATASET,
                           fix="Pass e.g. check_dataset((x_train, y_train)) or a tf.data.Dataset.")


def _check_same_length(data: Any) -> None:
    """Refuses (`ValueError`) in-memory arrays of different lengths, as `fit` does."""
    lengths = {name: int(leaf.shape[0]) for name, leaf in _named_leaves(data)
               if len(getattr(leaf, "shape", ())) >= 1}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{name}: {length}" for name, length in lengths.items())
        raise invalid_argument(
            "dataset", data, "arrays with the same number of samples (first dimension), as fit needs",
            fix=f"Their lengths differ ({listed}): pass as many targets and sample weights as inputs, "
            "e.g. check_dataset((x, y)) with len(x) == len(y).")


def _checked_batches(data: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """`batches`, each checked (`ValueError`) to hold arrays or tensors of rank >= 1, as `fit` needs."""
    for index, batch in enumerate(batches):
        leaves = [leaf for leaf in keras.tree.flatten(batch) if leaf is not None]
        wrong = [leaf for leaf in leaves if not hasattr(leaf, "shape") or len(leaf.shape) < 1]
        if wrong or not leaves:
            what = f"a value of type {type(wrong[0]).__name__}, not an array" if wrong else "no array"
            raise invalid_argument(
                "dataset", data, _DATASET,
                fix=f"Batch {index} holds {what}: pass the values as one array, "
                "e.g. np.array([1.0, 2.0, 3.0]), or batches of arrays, e.g. [(x0, y0), (x1, y1)].")
        yield batch


def _named_leaves(batch: Any) -> Iterator[tuple[str, Any]]:
    """``(name, leaf)`` of one batch, split as `fit` splits it: ``"x"``, ``"y"``, ``"sample_weight"``,
    with the key path of nested inputs (``"x/age"``); a component given as None is skipped."""
    parts = zip(_COMPONENTS, batch) if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 3 else [("x", batch)]
    for component, value in parts:
        if value is None:
            continue
        for path, leaf in keras.tree.flatten_with_path(value):
            yield "/".join([component, *map(str, path)]), leaf


def _components(batch: Any) -> list[tuple[str, np.ndarray]]:
    """Named float arrays of one batch (`_named_leaves`)."""
    arrays = [(name, np.asarray(leaf)) for name, leaf in _named_leaves(batch)]
    return [(name, a) for name, a in arrays if np.issubdtype(a.dtype, np.floating) or a.dtype == ml_dtypes.bfloat16]


#: Elements scanned at once (a float64 copy with a few masks), whatever the size of a batch.
_SCAN_CHUNK = 2**20


def _scan(array: np.ndarray, limits: Optional[tuple[float, float]]) -> dict[str, np.ndarray]:
    """Per-feature counts of each problem in one array, in chunks of `_SCAN_CHUNK` elements (whole
    rows, at least one); `limits` None skips the range checks."""
    rows = array.reshape(-1, array.shape[-1]) if array.ndim >= 2 else array.reshape(-1, 1)
    step = max(1, _SCAN_CHUNK // max(1, rows.shape[1]))
    total: dict[str, np.ndarray] = {}
    for start in range(0, max(len(rows), 1), step):
        for problem, counts in _scan_rows(rows[start : start + step].astype(np.float64), limits).items():
            total[problem] = total[problem] + counts if problem in total else counts
    return total


def _scan_rows(values: np.ndarray, limits: Optional[tuple[float, float]]) -> dict[str, np.ndarray]:
    """`_scan` of one chunk: a float64 [rows, features] array."""
    counts = {"nan": np.isnan(values).sum(0), "inf": np.isinf(values).sum(0)}
    if limits is not None:
        magnitude = np.abs(values)
        finite = np.isfinite(values)
        counts["overflow"] = (finite & (magnitude > limits[0])).sum(0)
        counts["underflow"] = ((magnitude > 0) & (magnitude < limits[1])).sum(0)
    return counts


def check_dataset(
    dataset: Any,
    policy: Union[None, str, keras.DTypePolicy] = None,
    max_batches: Optional[int] = None,
    *,
    batch_size: int = 32,
) -> DatasetReport:
    """Scans a data set for NaN, Inf and values the policy's compute dtype cannot hold.

    Every float component is checked for NaN and Inf. The inputs (`x`, which layers
    cast to the compute dtype) are also checked against its range: above its largest
    finite value they become Inf (float16: 65504), nonzero below its smallest
    subnormal they become 0 (float16: 2**-24, about 6e-8). Labels and sample weights
    reach the loss in float32 under Keras's mixed policies, so only NaN/Inf counts
    there. Integer components (token ids, class labels) are skipped.

    Args:
        dataset: `tf.data.Dataset` of batches (an unbatched one is scanned one
            element per "batch"), `keras.utils.PyDataset`, a NumPy array / tensor /
            dict of them / tuple `(x, y[, sample_weight])` (split into batches of
            `batch_size`, as `fit` does), or any iterable of batches, each an array or
            tensor of rank >= 1 or a tuple or dict of them (a plain list of numbers
            is refused: it is one array, not batches).
        policy: None (the global Keras policy), a `keras.DTypePolicy`, or one of
            `"mixed_float16"`, `"mixed_bfloat16"`, `"float16"`, `"bfloat16"`,
            `"float32"`, `"float64"`.
        max_batches: Int >= 1 or None. Batches to scan; None scans all (required
            for an infinite dataset).
        batch_size: Int >= 1. Batch size for in-memory arrays. Default 32. No upper
            bound: the scan works in chunks of 2**20 values, whatever the batch size.

    Returns:
        `DatasetReport`; `report.ok` is True when nothing was found and `str(report)`
        lists the issues by batch, component and feature.

    Warns:
        UserWarning: the data set holds no floating-point value (nothing was
            checked; `report.values_checked` is 0).

    Raises:
        ValueError: (template) `dataset` is a string or of no supported kind,
            yields a batch that holds a value of rank 0 (a number) or no array,
            or yields no batch; in-memory arrays of different lengths; `policy` is
            not one of those above; `max_batches` is not None or an int >= 1 (or
            None for an infinite data set); `batch_size` is not an int >= 1.

    Example:
        >>> x = np.ones((64, 3), "float32"); x[40, 2] = np.nan
        >>> report = check_dataset(x, policy="mixed_float16", batch_size=32)
        >>> report.issues
        [DatasetIssue(batch=1, component='x', feature=2, problem='nan', count=1)]
    """
    check_positive_int("max_batches", max_batches, allow_none=True,
                       fix="Pass e.g. max_batches=100, or None to scan all.")
    check_positive_int("batch_size", batch_size, fix="Pass e.g. batch_size=32 (the default).")
    dtype = _compute_dtype(policy)
    info = ml_dtypes.finfo(dtype)
    report = DatasetReport(dtype, float(info.max), float(info.smallest_subnormal))
    limits = (report.max_value, report.smallest_subnormal)
    for index, batch in enumerate(itertools.islice(_batches(dataset, max_batches, batch_size), max_batches)):
        report.batches_checked += 1
        for component, array in _components(batch):
            report.values_checked += int(array.size)
            counts = _scan(array, limits if component.startswith("x") else None)
            for problem, per_feature in counts.items():
                for feature in np.flatnonzero(per_feature):
                    column = int(feature) if array.ndim >= 2 else None
                    report.issues.append(DatasetIssue(index, component, column, problem, int(per_feature[feature])))
    if report.batches_checked == 0:
        raise invalid_argument(
            "dataset", dataset, "a data set that yields at least one batch",
            fix="It yielded none: check that it is not empty and that a generator was not already consumed.")
    if not report.values_checked:
        warn(f"check_dataset found no floating-point values in {report.batches_checked} batch(es): nothing was checked.",
             "It scans float inputs, targets and sample weights; strings and integer ids cannot hold NaN or Inf.",
             "Fix: check what the model computes on, e.g. check_dataset(dataset.map(preprocess)).",
             UserWarning, section="nan-or-inf-loss")
    return report
