"""Hub access without network: a missing download is a set-up error named with its fixes; a cached one loads."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONF


def _bench(tmp_path, *args, env):
    return subprocess.run([sys.executable, "-m", "bench.run", *args, f"results_dir={tmp_path / 'runs'}"],
                          cwd=CONF.parent, env=env, capture_output=True, text=True, timeout=300)


def _env(hf_home: Path, offline: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))}
    return env | {"HF_HOME": str(hf_home)} | ({"HF_HUB_OFFLINE": "1"} if offline else {})


@pytest.mark.parametrize("offline", [True, pytest.param(False, marks=pytest.mark.slow)],  # unreachable: make test-slow
                         ids=["HF_HUB_OFFLINE=1", "hub unreachable"])
def test_a_download_that_cannot_happen_is_a_config_error_naming_the_fixes(tmp_path, offline):
    out = _bench(tmp_path, "model=distilbert", "train.max_steps=1", env=_env(tmp_path / "empty-hf", offline))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "model distilbert-base-uncased, dataset stanfordnlp/imdb are not in the local cache" in out.stderr
    assert "make prepare" in out.stderr and "HF_HOME" in out.stderr and "distilbert_tiny" in out.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))  # no record, no empty dirs


@pytest.mark.parametrize("offline", [True, pytest.param(False, marks=pytest.mark.slow)],  # unreachable: make test-slow
                         ids=["HF_HUB_OFFLINE=1", "hub unreachable"])
def test_a_checkpoint_in_the_hub_cache_loads_without_network(tmp_path, make_checkpoint, offline):
    """The cache as `make prepare` leaves it: models--<org>--<name>/snapshots/<commit>/ and refs/main."""
    hf_home = tmp_path / "hf"
    repo = hf_home / "hub" / "models--acme--tiny-bert"
    shutil.copytree(make_checkpoint("bert"), repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    out = _bench(tmp_path, "model=bert_tiny", "model.pretrained=true", "model.hub_name=acme/tiny-bert",
                 "train.max_steps=2", env=_env(hf_home, offline))
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(next((tmp_path / "runs").rglob("result.json")).read_text())
    assert record["status"] == "ok" and record["model_source"]["commit"] == "0123abcd"
    assert record["model_source"]["checkpoint"] == "acme/tiny-bert"
