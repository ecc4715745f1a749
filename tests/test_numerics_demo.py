"""The demonstration: fp16 gradients underflow when the loss is multiplied down by 2^-16; dynamic loss
scaling, per-tensor scaling and unit scaling each keep them representable, and the model trains."""

import json
from pathlib import Path

import pytest

from bench.run import run_cell

STRESS = ["format=fp16", "format.backend=emulated", f"train.loss_multiplier={2.0**-16}", "train.max_steps=600"]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF

    root = tmp_path_factory.mktemp("demo")
    out = {}
    for scaling in ("none", "dynamic", "per_tensor", "unit"):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[f"results_dir={root}", f"scaling={scaling}", *STRESS])
        run_cell(cfg)
        out[scaling] = json.loads((Path(root) / cfg.cell / "result.json").read_text())
    return out


def _underflow(record):
    return record["numerics"]["quantisation"]["gradients"]["underflow_fraction"]


def test_unscaled_fp16_gradients_underflow_and_the_model_does_not_learn(records):
    assert _underflow(records["none"]) > 0.05
    assert records["none"]["metrics"]["test_accuracy"] < 0.5


@pytest.mark.parametrize("scaling", ["dynamic", "per_tensor", "unit"])
def test_scaling_keeps_gradients_representable_and_trains(records, scaling):
    assert _underflow(records[scaling]) < 0.03
    assert _underflow(records[scaling]) < _underflow(records["none"]) / 3
    assert records[scaling]["status"] == "ok" and records[scaling]["metrics"]["test_accuracy"] > 0.85


def test_per_tensor_scaling_records_amax_and_scale_statistics(records):
    gradients = records["per_tensor"]["numerics"]["quantisation"]["gradients"]
    assert gradients["underflow_fraction"] < 1e-3
    assert gradients["scale_max"] >= gradients["scale_min"] > 1  # small gradients are scaled up
    assert gradients["amax_max"] > 0
