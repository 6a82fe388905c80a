"""The command-line options the example scripts share, without importing TensorFlow.

Each script defines `parse_args` from these pieces and calls it before it imports
TensorFlow, Keras or tfmp: ``--help`` and usage errors then answer at once instead
of after TensorFlow's start-up (about 6 s on 2 CPU cores) and its log lines. So
does a missing optional package (`require`).
"""

from __future__ import annotations

import argparse
import importlib

# `tfmp.enable`'s policies (tfmp._src.policy.policy.POLICY_CHOICES, which imports
# TensorFlow with tfmp); tests/test_examples.py checks that the two agree.
POLICY_CHOICES = ("auto", "mixed_float16", "mixed_bfloat16", "float32")

#: The packages the examples import that tfmp itself does not install: module ->
#: (distribution name, the extra of setup.cfg that installs it).
OPTIONAL_PACKAGES = {"sklearn": ("scikit-learn", "examples")}
#: What `require("sklearn", ...)` is for in the digits scripts.
DIGITS_DATA = "the digits data set (scikit-learn's bundled handwritten digits)"


def require(module: str, needed_for: str) -> None:
    """Stops the script at once when optional package `module` cannot be imported.

    Call it before TensorFlow is imported, so that a missing package is said in
    a second, not after TensorFlow's start-up and a traceback.

    Args:
        module: String. A key of `OPTIONAL_PACKAGES`, e.g. ``"sklearn"``.
        needed_for: String. What needs it, as a noun phrase (`DIGITS_DATA`).

    Raises:
        SystemExit: (template) `module` raises ImportError on import (not
            installed, or installed without a dependency of its own); the
            message names the package, the extra that installs it and the
            command (exit status 1, the message on stderr).
    """
    try:
        importlib.import_module(module)
    except ImportError as error:
        distribution, extra = OPTIONAL_PACKAGES[module]
        raise SystemExit(
            f"Missing optional package {distribution!r} (module {module!r}). Expected "
            f"it installed: {needed_for} needs it, and tfmp's {extra!r} extra installs "
            f"it. Received: {type(error).__name__}: {error}. Install it with: "
            f'pip install "tfmp[{extra}]" (from a checkout of tfmp: '
            f'pip install ".[{extra}]").'
        ) from error


def positive_int(text: str) -> int:
    """Argparse type: an int >= 1, else a usage error naming what was received."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, received {text!r}")
    return value


def add_training_args(
    parser: argparse.ArgumentParser, *, epochs: int, batch_size: int, log_dir: str
) -> None:
    """Adds the options every example shares to `parser`.

    Options: ``--policy``, ``--epochs``, ``--steps``, ``--batch-size``,
    ``--log-dir`` and ``--seed``.

    Args:
        parser: `argparse.ArgumentParser` to extend.
        epochs: Int. Default of ``--epochs``.
        batch_size: Int. Default of ``--batch-size`` (examples per batch).
        log_dir: String. Default TensorBoard folder of ``--log-dir``.
    """
    parser.add_argument(
        "--policy",
        default="auto",
        choices=POLICY_CHOICES,
        help="auto (default: the fastest safe policy for this hardware), "
        "mixed_bfloat16, mixed_float16 or float32",
    )
    parser.add_argument(
        "--epochs",
        type=positive_int,
        default=epochs,
        help=f"passes over the training data (default {epochs})",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="batches per epoch (default: the whole training set); "
        "small values make a quick smoke run",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=batch_size,
        help=f"examples per batch (default {batch_size}); multiples "
        "of 8 suit Tensor Cores",
    )
    parser.add_argument(
        "--log-dir",
        default=log_dir,
        help=f"TensorBoard root folder; each run writes the loss scale and "
        f"overflow count to a new subfolder <log-dir>/<date-time> (default {log_dir})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of weights, shuffling and splits (default 0)",
    )


def add_data_dir_arg(parser: argparse.ArgumentParser) -> None:
    """Adds ``--data-dir``: where tensorflow-datasets keeps prepared data sets.

    Args:
        parser: `argparse.ArgumentParser` to extend.
    """
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder of prepared tensorflow-datasets data sets (default: "
        "$TFDS_DATA_DIR, else ~/tensorflow_datasets)",
    )
