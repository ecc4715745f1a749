"""bench/numerics/readings.py: values pushed on the device each step, read back in order in one transfer."""

import pytest
import torch

from bench.numerics.readings import Readings


@pytest.mark.parametrize("windowed", [False, True], ids=["rows", "window"])
def test_rows_come_back_in_order_once(windowed):
    readings = Readings(3, 2, windowed=windowed)
    assert readings.read() == []
    for step in range(5):  # more than the window held: it widens rather than drop a row
        readings.push(torch.tensor([step, 10.0 * step]))
    assert readings.read() == [[float(s), 10.0 * s] for s in range(5)]
    assert readings.read() == []
    readings.push(torch.tensor([7.0, 8.0]))
    assert readings.read() == [[7.0, 8.0]]
    assert readings.length == (6 if windowed else 3)


def test_a_pushed_row_is_kept_as_it_is_not_copied_and_the_window_is_xla_only():
    readings, loss = Readings(10**9), torch.tensor(2.5, requires_grad=True) * 1
    readings.push(loss)
    assert not readings.windowed and readings.window is None  # no kernel a push: nothing allocated on CPU
    assert readings.rows[0].data_ptr() == loss.data_ptr() and not readings.rows[0].requires_grad
    assert readings.read() == [[2.5]] and readings.rows == []


@pytest.mark.parametrize("windowed", [False, True], ids=["rows", "window"])
def test_16_bit_values_read_back_exactly_in_fp32_and_the_window_starts_small(windowed):
    readings = Readings(10**9, windowed=windowed)  # a loop that never logs allocates no more than MAX_START rows
    assert readings.length == Readings.MAX_START
    values = [torch.tensor(1 / 3, dtype=torch.bfloat16), torch.tensor(1 / 7, dtype=torch.bfloat16)]
    for value in values:
        readings.push(value)
    seen = []  # a combine (a distributed cell's average) works in FP32 too
    assert readings.read(lambda rows: seen.append(rows.dtype) or rows) == [[float(v)] for v in values]
    assert seen == [torch.float32]
