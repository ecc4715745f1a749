"""Download and cache every hub model and dataset the configs name, once, for compute nodes without internet.

    python -m bench.tools.prepare            # or: make prepare

Caches go where the Hugging Face libraries put them (HF_HOME, default ~/.cache/huggingface); point
HF_HOME at a shared filesystem before running this on a login node, then set HF_HOME to the same path
and HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 on the compute nodes.
"""

from __future__ import annotations

import sys

from hydra import compose, initialize_config_dir

from bench.running.config import CONF_DIR


def hub_assets() -> tuple[list[tuple[str, str]], list[str]]:
    """(transformers class, checkpoint) pairs and dataset ids that the model configs in conf/model/ can load from
    the hub: a checkpoint where the model declares `task.hub_model`, a dataset where `hub` is one of its data
    sources. Each once, in the order the configs name them."""
    models, data = {}, {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for option in sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")):
            cfg = compose("config", overrides=[f"model={option}"]).model
            if "hub" in cfg.task.data_sources:
                data[cfg.data.name] = None
            if cfg.task.hub_model:
                models[(cfg.task.hub_model, cfg.hub_name)] = None
    return list(models), list(data)


def main() -> int:
    import datasets
    import transformers

    from bench.data import hub

    if not hub.reachable():
        print(f"make prepare downloads from the Hugging Face hub, which cannot be reached from here "
              f"(or HF_HUB_OFFLINE=1 is set). Run it where there is internet; {hub.FIXES}.", file=sys.stderr)
        return 2
    models, data = hub_assets()
    for cls, name in models:
        print(f"model {name}", file=sys.stderr)
        transformers.AutoTokenizer.from_pretrained(name)
        getattr(transformers, cls).from_pretrained(name)
    for name in data:
        print(f"dataset {name}", file=sys.stderr)
        datasets.load_dataset(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
