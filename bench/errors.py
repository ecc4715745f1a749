"""The one exception every layer may raise for a set-up mistake; it imports nothing from bench.

A ConfigError stops a cell before training with exit code 2 and no record (bench/running/run.py): a bad option,
a missing file, a download that cannot happen. `bench.running.config.ConfigError` is the same class.
"""


class ConfigError(ValueError):
    """The composed config asks for something that does not exist or cannot be combined, or its inputs are
    not there."""
