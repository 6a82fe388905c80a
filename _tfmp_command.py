"""The `tfmp` command line: ``tfmp doctor [--json]`` (also ``python -m tfmp doctor``).

A module of its own, outside the `tfmp` package: ``import tfmp`` imports TensorFlow
and Keras (about 6 s), so the console script starts here and parses its arguments
first, and ``--help`` and usage errors answer at once. ``python -m tfmp`` runs
``tfmp/__main__.py``, for which `tfmp/__init__.py` defers its imports.

Installed as a console script by setup.cfg::

    [options]
    py_modules = _tfmp_command

    [options.entry_points]
    console_scripts =
        tfmp = _tfmp_command:run
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, NoReturn, Optional, Sequence

if TYPE_CHECKING:
    from tfmp import DeviceFacts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfmp", description="tfmp: safe, fast and visible mixed precision.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "doctor", help="report versions, devices, TF32/XLA and the recommended policy",
        description="Report what this machine offers for mixed precision.")
    check.add_argument("--json", action="store_true", help="print JSON for programs")
    return parser


def main(argv: Optional[Sequence[str]] = None,
         device_facts: Optional[DeviceFacts] = None) -> int:
    """Runs the `tfmp` command line.

    Args:
        argv: Sequence of strings or None (``sys.argv[1:]``), e.g. ``["doctor"]``.
        device_facts: `DeviceFacts` or None. Devices to report on instead of this
            machine's (for tests).

    Returns:
        Int exit status: 0 on success. Invalid arguments exit with status 2
        (argparse's `SystemExit`).
    """
    args = _parser().parse_args(argv)
    if args.command == "doctor":
        if device_facts is None:  # oneDNN's ISA read in a child beside TensorFlow's import
            from tfmp._src.policy import onednn_isa  # no TensorFlow under python -m tfmp

            onednn_isa.start_early()
        from tfmp._src.advisors.doctor import doctor  # imports TensorFlow

        doctor(device_facts, as_json=args.json, file=sys.stdout)
    return 0


def run() -> NoReturn:
    """The console script and ``python -m tfmp``: `main`, then the process ends at once.

    Once the report is printed and flushed, ``os._exit`` skips the interpreter's
    teardown of TensorFlow, which holds nothing left to save and took 3 s of a
    21 s ``tfmp doctor`` on a 2-core AMD EPYC Zen 3 at a load average of 6.
    An error (argparse's `SystemExit` included) leaves the ordinary way.
    """
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
