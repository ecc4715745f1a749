"""(Lives in the hydra_plugins namespace because Hydra only instantiates sweepers from there.)

Hydra's basic sweeper with two additions: every cell of a sweep is checked before the first one
trains (a bad combination anywhere in the grid costs nothing), and the sweep ends with a status
summary and a non-zero exit if any cell failed."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

from bench.config import ConfigError

SUMMARY_ORDER = ("ok", "diverged", "failed")


class CheckingSweeper(BasicSweeper):
    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        from bench.run import preflight  # the runner's own checks, nothing re-implemented

        for overrides in batch:
            cfg = self.hydra_context.config_loader.load_sweep_config(
                master_config=self.config, sweep_overrides=list(overrides))
            try:
                preflight(cfg)
            except ConfigError as e:
                print(f"config error in cell [{' '.join(overrides)}]: {e}", file=sys.stderr)
                sys.exit(2)

    def sweep(self, arguments: list[str]) -> Any:
        returns = super().sweep(arguments)
        statuses = Counter(job.return_value for batch in returns for job in batch)
        print("sweep: " + ", ".join(f"{statuses.get(s, 0)} {s}" for s in SUMMARY_ORDER), file=sys.stderr)
        if statuses.get("failed"):
            sys.exit(1)
        return returns
