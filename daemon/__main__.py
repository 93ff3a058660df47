"""`python -m lmd` is `lmdd`."""

from __future__ import annotations

import sys

from lmd.cli import main

if __name__ == "__main__":
    sys.exit(main())
