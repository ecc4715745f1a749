"""bench/numerics/readings.py: values pushed on the device each step, read back in order in one transfer."""

import torch

from bench.numerics.readings import Readings


def test_rows_come_back_in_order_once_and_a_full_window_widens():
    readings = Readings(3, 2)
    assert readings.read() == []
    for step in range(5):  # more than the window held: it widens rather than drop a row
        readings.push(torch.tensor([step, 10.0 * step]))
    assert readings.read() == [[float(s), 10.0 * s] for s in range(5)]
    assert readings.read() == []
    readings.push(torch.tensor([7.0, 8.0]))
    assert readings.read() == [[7.0, 8.0]] and readings.length == 6


def test_a_16_bit_value_reads_back_exactly_and_the_window_starts_small():
    readings = Readings(10**9)  # a loop that never logs allocates no more than MAX_START rows
    assert readings.length == Readings.MAX_START
    value = torch.tensor(1 / 3, dtype=torch.bfloat16)
    readings.push(value)
    assert readings.read() == [[float(value)]]
