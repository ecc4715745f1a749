"""Values a training loop makes on the device at each step and reads on the host only now and then (losses,
loss-scale flags), read in one transfer of one shape.

A window of the last `length` rows stays on the device and shifts by one row per push. Reading it is the same
graph whatever number of steps it covers, and so is every push: XLA compiles a graph per shape and per set of
inputs, and a stack of however many tensors had piled up since the last read compiled anew whenever their
number changed (an epoch's end between two log steps). Elsewhere it costs one small copy per step.
"""

from __future__ import annotations

import torch


class Readings:
    MAX_START = 1024  # rows allocated up front at most (a loop that logs every 10^9 steps must not get 4 GB)

    def __init__(self, length: int, width: int = 1):
        self.length, self.width = max(1, min(length, self.MAX_START)), width
        self.window: torch.Tensor | None = None
        self.pending = 0  # rows pushed since the last read, at the window's end

    def push(self, row: torch.Tensor) -> None:
        """Append `row` (`width` values; FP32, which holds a 16-bit value exactly) without reading it."""
        row = row.detach().reshape(1, self.width).float()
        if self.window is None:
            self.window = torch.zeros(self.length, self.width, device=row.device)
        if self.pending == self.length:  # more rows than the window holds before a read: widen it (one new shape)
            self.window = torch.cat([torch.zeros_like(self.window), self.window])
            self.length *= 2
        self.window = torch.cat([self.window[1:], row])
        self.pending += 1

    def read(self) -> list[list[float]]:
        """The rows pushed since the last read, oldest first (one transfer)."""
        if not self.pending:
            return []
        rows = self.window.tolist()[self.length - self.pending:]
        self.pending = 0
        return rows
