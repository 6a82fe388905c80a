"""``python -m tfmp doctor [--json]``: the `tfmp` command line."""

import sys

from tfmp.cli import main

if __name__ == "__main__":
    sys.exit(main())
