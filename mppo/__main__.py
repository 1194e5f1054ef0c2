"""`python -m mppo ...` and `torchrun -m mppo ...`: the same command line as the `mppo` console script."""
from __future__ import annotations

from mppo.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
