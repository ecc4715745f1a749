"""Did a run learn as its siblings did? A run that trains without a NaN but stops learning (a dead ReLU network at
chance, a language model that only learned its characters' frequencies) is recorded `ok` and would be averaged with
its siblings, the other seeds of its cell, as if it were noise. This module is the rule that tells it apart.

Per run, from its training curve (the loss at its log steps): `early`, the loss a tenth of the way into training
(the median of the logged losses between 5% and 15% of its steps), and `final`, the loss at its end (the mean of
those in its last 10%). Medians and means over windows, because a logged loss is one batch's.

The rule: a run **stalled** when its final loss is higher than the median of its siblings' early losses (after all
its training it has not reached where its siblings were a tenth of the way in), while its siblings went on learning
(the median of their early-to-final drops is at least a tenth of their median early loss). It needs two siblings or
more: with one, the pair cannot say which of them is the odd one. Seeds of one cell start alike and train alike; a
run that ends behind its siblings' early state did not learn as they did, whatever the model or its loss's scale,
and a seed that is merely worse, or learned faster at first, ends far below that line (docs/results.md gives the
committed tables' margins). Where the siblings did not go on learning either (a cell stalled as a whole, or one
trained too briefly for its loss to move), no run is flagged: nothing in the cell learned for it to fall behind.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.running.identity import config_hash, semantic_config
from bench.running.record import logged_losses, previous_record, write_json_atomic

EARLY = (0.05, 0.15)  # the early window, as fractions of a run's steps
FINAL = 0.10  # the final window: the last tenth of a run's steps
MIN_SIBLINGS = 2
LEARNED = 0.10  # the siblings' median early-to-final drop, as a fraction of their median early loss, that counts
RULE = ("stalled: its final loss (mean of the logged losses in the last 10% of its steps) is above the median of its "
        "siblings' early losses (each the median of the logged losses between 5% and 15% of its steps), and the "
        "siblings went on learning (their median early-to-final drop is at least 10% of that median); with at "
        "least 2 siblings (the cell's other finished seeds)")


def learning_summary(curve: list, steps: int | None) -> dict | None:
    """`early` and `final` loss of a run's training curve (`[step, loss]` pairs at its log steps) over `steps` trained
    steps; None without a finite loss to read."""
    points = [(s, loss) for s, loss in curve or () if isinstance(loss, (int, float)) and loss == loss
              and abs(loss) != float("inf")]
    if not points:
        return None
    steps = max(steps or 0, points[-1][0] + 1)
    early = [loss for s, loss in points if EARLY[0] * steps <= s <= EARLY[1] * steps]
    if not early:  # log steps too coarse for the window: the logged loss nearest a tenth of the way in
        early = [min(points, key=lambda p: abs(p[0] - steps * sum(EARLY) / 2))[1]]
    final = [loss for s, loss in points if s >= (1 - FINAL) * steps] or [points[-1][1]]
    return {"early_loss": statistics.median(early), "final_loss": statistics.fmean(final),
            "early_points": len(early), "final_points": len(final), "steps": steps}


def stalled_verdict(run: dict | None, siblings: list[dict | None]) -> dict | None:
    """The rule (RULE) for one run's `learning_summary` against its siblings'; None where it cannot be decided (no
    curve, or fewer than MIN_SIBLINGS siblings with one). The verdict carries the numbers it was decided on."""
    siblings = [s for s in siblings if s is not None]
    if run is None or len(siblings) < MIN_SIBLINGS:
        return None
    line = statistics.median(s["early_loss"] for s in siblings)
    drop = statistics.median(s["early_loss"] - s["final_loss"] for s in siblings)
    return {"stalled": run["final_loss"] > line and drop >= LEARNED * line, "final_loss": run["final_loss"],
            "siblings_early_loss": line, "siblings_drop": drop, "siblings": len(siblings)}


def learning_of(record: dict, curve: list | None = None) -> dict | None:
    """A record's `numerics.learning`; for a record made before it was recorded, the same from its curve (`curve`, or
    the `_losses` an aggregated record carries)."""
    if "learning" in record.get("numerics", {}):
        return record["numerics"]["learning"]
    return learning_summary(record.get("_losses") if curve is None else curve, record.get("timing", {}).get("steps"))


def sibling_key(config: dict) -> str:
    """What a run shares with its siblings: its run identity without the seed."""
    semantic = semantic_config(config)
    semantic.pop("seed", None)
    return config_hash(semantic)


def judge(run_dirs) -> list[str]:
    """After a sweep: each finished run's verdict (`stalled_verdict`) against its siblings among the cells of
    `run_dirs`, written into its record as `numerics.stalled` where it changed (an atomic rewrite of result.json:
    the sweep is over, nothing else writes these records now); returns the cells of the runs that stalled."""
    found = {}
    for run_dir in map(Path, run_dirs):
        record, _ = previous_record(run_dir)
        if record is not None and record["status"] == "ok":
            found[run_dir] = (record, learning_of(record, logged_losses(run_dir)))
    groups: dict[str, list[Path]] = {}
    for run_dir, (record, _) in found.items():
        groups.setdefault(sibling_key(record["config"]), []).append(run_dir)
    stalled = []
    for members in groups.values():
        for run_dir in members:
            record, summary = found[run_dir]
            verdict = stalled_verdict(summary, [found[other][1] for other in members if other != run_dir])
            if verdict is not None and verdict["stalled"]:
                stalled.append(record["config"].get("cell") or str(run_dir))
            if record["numerics"].get("stalled", "unset") != verdict:
                record["numerics"]["stalled"] = verdict
                write_json_atomic(run_dir / "result.json", record)
    return stalled
