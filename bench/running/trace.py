"""Moved to bench.speed.trace (0.3.0); this alias goes in the next release."""

from bench.speed.trace import StepTrace, TracedOp, trace_cell, trace_step, trace_task  # noqa: F401
