"""Values a training loop makes on the device at each step and reads on the host only now and then (losses,
loss-scale flags), read in one transfer of one shape.

On CPU and CUDA a push writes its row in place, at the next free row of a window of `length` rows (one small
kernel: a shifted window cost 0.17 ms a step on LeNet, 2.5% of its step, where the harness allows 3%). On XLA the
window shifts by one row per push instead, so that reading it is the same graph whatever number of steps it covers,
and so is every push: XLA compiles a graph per shape and per set of inputs (a write at a row that moves is another
graph each step), and a stack of however many tensors had piled up since the last read compiled anew whenever their
number changed (an epoch's end between two log steps).
"""

from __future__ import annotations

import torch


class Readings:
    MAX_START = 1024  # rows allocated up front at most (a loop that logs every 10^9 steps must not get 4 GB)

    def __init__(self, length: int, width: int = 1):
        self.length, self.width = max(1, min(length, self.MAX_START)), width
        self.window: torch.Tensor | None = None
        self.pending = 0  # rows pushed since the last read: the window's first rows (XLA: its last)

    @property
    def shifts(self) -> bool:
        """On XLA the window shifts by a row per push (the module docstring says why); elsewhere rows are written in
        place."""
        return self.window.device.type == "xla"

    def push(self, row: torch.Tensor) -> None:
        """Append `row` (`width` values; kept in FP32, which holds a 16-bit value exactly) without reading it."""
        if self.window is None:
            self.window = torch.zeros(self.length, self.width, device=row.device)
        if self.pending == self.length:  # more rows than the window holds before a read: widen it (one new shape)
            halves = [torch.zeros_like(self.window), self.window]
            self.window = torch.cat(halves if self.shifts else halves[::-1])
            self.length *= 2
        if self.shifts:
            self.window = torch.cat([self.window[1:], row.detach().reshape(1, self.width).float()])
        else:  # one copy, which converts the dtype (a step of a small model is ~4 ms; each op here is ~2 us)
            self.window.select(0, self.pending).copy_(row.detach().reshape(self.width))
        self.pending += 1

    def read(self, combine=None) -> list[list[float]]:
        """The rows pushed since the last read, oldest first (one transfer); `combine(rows)` first where given (a
        distributed cell's average over its ranks: one collective per read, not per push)."""
        if not self.pending:
            return []
        combine = combine or (lambda rows: rows)
        if self.shifts:  # the whole window, sliced on the host: one graph whatever the count (the module docstring)
            rows = combine(self.window).tolist()[self.length - self.pending:]
        else:
            rows = combine(self.window[:self.pending]).tolist()
        self.pending = 0
        return rows
