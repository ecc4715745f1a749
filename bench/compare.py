"""`python -m bench.compare MINE [--against FOLDER]`: your cells beside committed ones (bench/reporting/compare.py)."""

import sys

from bench.reporting.compare import main

if __name__ == "__main__":
    sys.exit(main())
