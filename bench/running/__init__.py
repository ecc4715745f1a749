"""Running a grid: configuration and its checks, the cell runner and training loop, checkpoints, devices,
records, loggers, the hub."""
