"""Values a training loop makes on the device at each step and reads on the host only now and then (losses,
loss-scale flags), read in one transfer.

On CPU and CUDA a push keeps the row itself (no kernel) and a read stacks the rows pushed since the last one: a
push that wrote its row into a window cost 20 µs a step of LeNet's 0.9 ms at batch 1, in a loop whose whole cost
over a bare loop's is under 3% of a step (docs/performance.md). A pushed row must not be written afterwards (the
loop's losses and the loss scaler's stacked flags are new tensors each step; CUDA graphs, which reuse their outputs,
are not used). On XLA the rows go into a window of `length` rows that shifts by one row per push instead, so that
reading it is the same graph whatever number of steps it covers, and so is every push: XLA compiles a graph per shape
and per set of inputs (a write at a row that moves is another graph each step), and a stack of however many tensors
had piled up since the last read compiled anew whenever their number changed (an epoch's end between two log steps).
"""

from __future__ import annotations

import torch


class Readings:
    MAX_START = 1024  # window rows allocated up front at most (a loop that logs every 10^9 steps must not get 4 GB)

    def __init__(self, length: int, width: int = 1, windowed: bool | None = None):
        """`windowed`: keep the rows in the shifting window (by default on XLA only; a test asks for it on CPU)."""
        self.length, self.width, self.windowed = max(1, min(length, self.MAX_START)), width, windowed
        self.rows: list[torch.Tensor] = []  # unwindowed: the rows pushed since the last read, still on the device
        self.window: torch.Tensor | None = None
        self.pending = 0  # rows pushed since the last read (windowed: the window's last)

    def push(self, row: torch.Tensor) -> None:
        """Append `row` (`width` values) without reading it; it reads back in FP32, which holds a 16-bit value
        exactly."""
        if self.windowed is None:
            self.windowed = row.device.type == "xla"
        self.pending += 1
        if not self.windowed:
            self.rows.append(row.detach())
            return
        if self.window is None:
            self.window = torch.zeros(self.length, self.width, device=row.device)
        if self.pending > self.length:  # more rows than the window holds before a read: widen it (one new shape)
            self.window = torch.cat([torch.zeros_like(self.window), self.window])
            self.length *= 2
        self.window = torch.cat([self.window[1:], row.detach().reshape(1, self.width).float()])

    def read(self, combine=None) -> list[list[float]]:
        """The rows pushed since the last read, oldest first (one transfer); `combine(rows)` first where given (a
        distributed cell's average over its ranks: one collective per read, not per push)."""
        if not self.pending:
            return []
        combine = combine or (lambda rows: rows)
        if self.windowed:  # the whole window, sliced on the host: one graph whatever the count (the module docstring)
            rows = combine(self.window).tolist()[self.length - self.pending:]
        else:  # one stack, which converts the dtype
            rows = combine(torch.stack(self.rows).reshape(self.pending, self.width).float()).tolist()
            self.rows = []
        self.pending = 0
        return rows
