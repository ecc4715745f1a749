"""A format declared outside bench/ (here: FP8 E3M4, in this test) is one FormatSpec and its element format: config
validation, the precision policy, a training cell, the device matrix and the tables all find it in the registry."""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from bench.numerics import formats, specs
from bench.numerics.specs import FormatSpec, Recipe
from bench.running.config import ConfigError, check


@pytest.fixture
def e3m4(monkeypatch):
    """OCP-style FP8 E3M4 (IEEE-like: bias 3, inf and NaN), registered for the test only."""
    element = formats.ElementFormat.from_bits("fp8_e3m4", 3, 4)
    monkeypatch.setitem(formats.FORMATS, "fp8_e3m4", element)
    spec = FormatSpec("fp8e3m4", ("mixed",), Recipe("fp8_e3m4", "fp8_e3m4", False),
                      specs.hardware.emulated_everywhere("fp8e3m4 has no native path: a test format"),
                      stochastic_rounding=True)
    monkeypatch.setitem(specs.FORMAT_SPECS, "fp8e3m4", spec)
    return spec


def test_the_new_element_format_rounds_as_ml_dtypes_does(e3m4):
    grid = np.concatenate([np.linspace(-20, 20, 4001), 2.0 ** np.arange(-12, 5), [0.0, 15.5, 15.75, 16.0]])
    x = torch.tensor(grid, dtype=torch.float32)
    ours = formats.quantise_value(x, "fp8_e3m4").numpy()
    reference = grid.astype(np.float32).astype(ml_dtypes.float8_e3m4).astype(np.float32)
    np.testing.assert_array_equal(ours, reference)


def test_a_registered_format_trains_a_cell_and_is_tabled(e3m4, make_cfg, tmp_path):
    from bench.reporting import aggregate, tables
    from bench.running.run import run_cell

    cfg = make_cfg("format=fp8", "format.name=fp8e3m4", "format.elsewhere=null", "train.max_steps=3",
                   "format.rounding=stochastic")
    check(cfg)
    run_cell(cfg)
    record = json.loads((Path(cfg.results_dir) / cfg.cell / "result.json").read_text())
    precision = record["env"]["precision"]
    assert record["status"] == "ok" and cfg.cell.startswith("default/lenet/fp8e3m4-mixed/none/")
    assert (precision["setting"], precision["backend"], precision["element_formats"]) == \
        ("fp8e3m4-mixed", "emulated", ["fp8_e3m4"])
    assert "a test format" in precision["backend_reason"]
    assert record["numerics"]["quantisation"]["activations"]["values_sampled"] > 0
    frame = aggregate.to_frame([record | {"_dir": None}])
    assert list(frame["setting"].cat.categories)[-1] == "fp8e3m4-mixed"  # the registry's order, it came last
    written = tables.write_all(frame, aggregate.summarise(frame), tmp_path / "tables")
    assert "fp8e3m4-mixed †" in written["precision"]  # emulated, marked


def test_a_registered_format_has_a_device_matrix_column_and_its_rules(e3m4, make_cfg):
    from bench.tools.matrix import PROFILES, decide, markdown

    assert "| fp8e3m4-mixed |" in markdown().splitlines()[0] + "|"
    assert {decide(p, "fp8e3m4", "mixed", "none")[0] for p in PROFILES} == {"emulated"}
    with pytest.raises(ConfigError, match="scaling=rowwise does not combine with format=fp8e3m4.*valid for fp8e3m4: "
                                          "none, static, dynamic, per_tensor, unit"):
        check(make_cfg("format=fp8", "format.name=fp8e3m4", "scaling=rowwise"))


def test_an_unregistered_format_is_refused_naming_the_registered_ones(make_cfg):
    with pytest.raises(ConfigError, match="format='fp9' is not valid; valid: fp32, tf32, fp16, bf16, fp8, mxfp8"):
        check(make_cfg("format=fp8", "format.name=fp9"))
