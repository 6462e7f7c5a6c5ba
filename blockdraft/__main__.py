"""`python -m blockdraft ...`: the `blockdraft` command (e.g. where the console script is not on PATH)."""

import sys

from blockdraft.cli import main

if __name__ == "__main__":
    sys.exit(main())
