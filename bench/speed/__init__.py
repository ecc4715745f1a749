"""The speed model: a cell's training step traced on the meta device (trace.py), priced per GPU profile (profiles.py)
op by op, its GEMMs by shape, type and kernel (gemm.py), compiled and eager (model.py). Below running/ (the runner
records each cell's prediction), reporting/ and tools/ (bench.predict, make speed-validation)."""
