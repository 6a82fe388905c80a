"""The `tfmp` command line: ``tfmp doctor [--json]`` (also ``python -m tfmp doctor``).

Arguments are parsed before TensorFlow is imported (``tfmp/__init__.py`` imports
nothing heavy), so ``--help`` and usage errors answer at once.

Installed as a console script by setup.cfg::

    [options.entry_points]
    console_scripts =
        tfmp = tfmp.cli:main
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from tfmp._src.policy.hardware import DeviceFacts  # no TensorFlow import


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
        from tfmp._src.advisors.doctor import doctor  # imports TensorFlow

        doctor(device_facts, as_json=args.json, file=sys.stdout)
    return 0
