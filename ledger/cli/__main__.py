"""``python -m ledger.cli``: the same as the ``vram`` console script."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
