"""Commands around the grid: benchmark, doctor, prepare, chaos, the device matrix, block-format conformance,
Raschka's memory comparison."""
