#!/usr/bin/env python3
"""Build the site: ``python build.py [--ledger PATH] [--out DIR] [--build-date DATE]``.

The same as ``vram build``; the rendering lives in ``ledger.site``.
"""

import sys

from ledger.cli import main

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
