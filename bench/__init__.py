"""precision-bench: what a numeric format and a scaling method cost in accuracy and gain in time and memory."""

# the one home of the version: pyproject.toml reads it, every record carries it (env.version)
__version__ = "0.3.0.dev0"
