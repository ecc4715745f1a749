"""`python -m bench.run [overrides]`: train the cells of a grid (the runner lives in bench/running/run.py)."""

from bench.running.run import main

if __name__ == "__main__":
    main()
