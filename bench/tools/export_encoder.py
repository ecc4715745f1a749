"""A pretrained masked-LM cell as a transformers checkpoint directory, for the QA task to fine-tune (the Unit Scaling
paper's second step): the encoder's configuration and weights from the cell's kept checkpoint (train.keep_checkpoint
=true), the tokenizer's vocabulary, and the parametrisation it was trained in.

    python -m bench.tools.export_encoder <cell directory> <output directory>

A unit-scaled model's weights compute its function only through unit scaling's ops (N(0, 1) weights, each matmul
scaled), so the checkpoint says so (bench.tasks.base.CHECKPOINT_MARKS: its parametrisation, its post-norm branch
weight): the QA task rebuilds it unit-scaled around those weights (scaling=unit), and any other scaling method
refuses it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.errors import ConfigError


def export(cell: Path, out: Path) -> Path:
    """Write `cell`'s trained encoder to `out` (a directory transformers' from_pretrained reads); returns `out`."""
    import torch
    from omegaconf import OmegaConf

    from bench.numerics.scaling_methods import build
    from bench.running.checkpoint import CHECKPOINT_NAME
    from bench.tasks.base import CHECKPOINT_MARKS
    from bench.tasks.mlm import build_encoder, tokenizer_of

    record_path, checkpoint = cell / "result.json", cell / CHECKPOINT_NAME
    if not record_path.is_file():
        raise ConfigError(f"{cell}: no result.json (not a finished cell)")
    cfg = OmegaConf.create(json.loads(record_path.read_text())["config"])
    if cfg.model.task._target_ != "bench.tasks.mlm.mlm_task":
        raise ConfigError(f"{cell} is a {cfg.model.name} cell; only a masked-LM cell (bench.tasks.mlm) exports an "
                          "encoder")
    if not checkpoint.is_file():
        raise ConfigError(f"{cell}: no {CHECKPOINT_NAME}; run the cell with train.keep_checkpoint=true to keep it")
    tokenizer = tokenizer_of(cfg.model)
    model = build_encoder(cfg.model, tokenizer)
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False)["model"])
    marks = {"parametrisation": build(cfg.scaling).parametrisation, "post_norm_tau": cfg.scaling.get("post_norm_tau")}
    for key in CHECKPOINT_MARKS:
        if marks[key] is not None:
            setattr(model.config, f"precision_bench_{key}", marks[key])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.export_encoder", description=__doc__.split("\n\n")[0])
    parser.add_argument("cell", type=Path, help="a finished masked-LM cell's directory (train.keep_checkpoint=true)")
    parser.add_argument("out", type=Path, help="the transformers checkpoint directory to write")
    args = parser.parse_args(argv)
    try:
        print(export(args.cell, args.out))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
