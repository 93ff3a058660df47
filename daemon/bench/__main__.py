"""`python -m lmd.bench` is `lmd-bench`."""

from __future__ import annotations

import sys

from lmd.bench import main

if __name__ == "__main__":
    sys.exit(main())
