"""Hugging Face hub access that fails fast, before training, and says how to fix it.

Without network, transformers and datasets retry for about a minute before they give up; a cell then
fails with a raw OSError. Here the decision comes first: if the hub answers, load as usual; if it does
not (or HF_HUB_OFFLINE=1), load from the local cache only, and if something is not cached, stop with a
ConfigError that names it and the fixes. A missing download is a setup error, not a result: no record.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from bench.errors import ConfigError

FIXES = ("run `make prepare` once where there is internet (with HF_HOME on a filesystem this machine sees), "
         "then set the same HF_HOME here; on nodes without internet also set HF_HUB_OFFLINE=1 "
         "HF_DATASETS_OFFLINE=1; or use what needs no download: model=distilbert_tiny / bert_tiny "
         "(model.data.source=local), or LeNet on model.data.source=digits")


def reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's endpoint accepts a connection (False at once in offline mode)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def model_cached(name: str) -> bool:
    """A local directory, or a hub checkpoint whose config.json is in the hub cache."""
    from huggingface_hub import try_to_load_from_cache

    return Path(name).is_dir() or isinstance(try_to_load_from_cache(name, "config.json"), str)


def dataset_cached(name: str) -> bool:
    """A dataset in the hub cache (datasets keeps the repository's files there) or in datasets' own cache."""
    import datasets
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}" / "snapshots"
    prepared = Path(datasets.config.HF_DATASETS_CACHE) / name.replace("/", "___")
    return (snapshots.is_dir() and any(snapshots.iterdir())) or prepared.is_dir()


def require(models: list[str] = (), data: list[str] = ()) -> bool:
    """Check that the named checkpoints and datasets can be had; return whether they load from the cache only
    (the hub is unreachable and everything is cached: the libraries are switched to offline mode).

    Raises ConfigError, naming what is missing and how to get it, when the hub cannot be reached and
    something is not cached.
    """
    wanted = [m for m in models if not Path(m).is_dir()]
    if not wanted and not data:
        return False
    if reachable():
        return False
    missing = [f"model {m}" for m in wanted if not model_cached(m)] + [f"dataset {d}" for d in data
                                                                       if not dataset_cached(d)]
    if missing:
        raise ConfigError(f"the Hugging Face hub cannot be reached from here and {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not in the local cache. To fix: {FIXES}")
    _go_offline()
    return True


def _go_offline() -> None:
    """Load from the cache only, without the minute of retries (what HF_HUB_OFFLINE=1 at start-up does)."""
    import datasets
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True  # transformers asks huggingface_hub.is_offline_mode()
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
