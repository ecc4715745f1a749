"""`python -m bench.predict [overrides] [gpu=...]`: the speed model's step time, speed-up and memory for cells that
are not trained (bench/reporting/predict_cells.py)."""

import sys

from bench.reporting.predict_cells import main

if __name__ == "__main__":
    sys.exit(main())
