"""``python -m tfmp doctor [--json]``: the `tfmp` command line (`_tfmp_command`)."""

import sys

from _tfmp_command import run

if __name__ == "__main__":
    sys.exit(run())
