"""Compose the real configs (conf/) with Hydra's compose API, as the runner would."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import bench.config  # noqa: F401 - registers the schema and the `lower` resolver

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture
def make_cfg(tmp_path):
    """make_cfg("format=fp16", ...) -> the composed DictConfig, writing under tmp_path."""

    def _make(*overrides):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("config", overrides=[f"results_dir={tmp_path}", *overrides])

    return _make
