"""`python -m bench.aggregate SOURCE... [--out DIR]`: tables and plots from run records (bench/reporting/)."""

import sys

from bench.reporting.report import main

if __name__ == "__main__":
    sys.exit(main())
