"""Time to quality, as MLPerf Training measures it: how many steps a run takes to reach a quality target, and what
those steps would take on a GPU by the speed model's prediction (bench/speed/model.py).

A run's quality curve is its task's validation metric at each evaluation (`metrics.curve`: after each epoch, or
every `model.task.eval_every` steps from step 0, and at the end). The target of a run is, by default, the final
value of that curve for the 32-true run of the same seed and otherwise the same configuration (the FP32 run reaches
it at its own end, or earlier if its curve passed it on the way), and where no 32-true run has the cell's scaling
method (block_formats runs FP32 unscaled only) the unscaled 32-true run's: the quality FP32 reaches without the
method, as MLPerf fixes one target for every submission; a preset may declare its own
(`hydra.sweeper.quality_target`, in the metric's recorded units). The steps to target are those of the first
evaluation at which the curve reaches the target (at or above it where higher is better, at or below it where
lower is); a run whose curve never does has none, and says so: no number is made up for it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bench.numerics.scaling_methods import NO_SCALING
from bench.running.config import preset_sweeper

NEAR_CHANCE = 0.1  # a tenth of the way from chance to a perfect score, or less: nothing learned to compare against


def near_chance(value: float, chance: float | None, higher_is_better: bool, best: float) -> bool:
    """Whether `value` (a 32-true cell's mean) lies within NEAR_CHANCE of the way from the task's declared `chance`
    to `best` (the unit's perfect score: 1 for a fraction, 0 for a loss); False where chance is not declared."""
    if chance is None or pd.isna(chance) or pd.isna(value):
        return False
    return bool(abs(value - chance) <= NEAR_CHANCE * abs(best - chance)) and (
        (value <= best) if higher_is_better else (value >= best))


def steps_to_target(points: list, target: float, higher_is_better: bool) -> int | None:
    """The step of the first point of `points` ([step, value], in step order) that reaches `target`; None if none."""
    for step, value in points:
        if value is not None and not pd.isna(value) and (value >= target if higher_is_better else value <= target):
            return int(step)
    return None


def declared_target(experiment: str) -> float | None:
    """A preset's own quality target (`hydra.sweeper.quality_target` in conf/experiment/<experiment>.yaml), if any."""
    value = (preset_sweeper(experiment) or {}).get("quality_target")
    return None if value is None else float(value)


def targets(frame: pd.DataFrame) -> pd.DataFrame:
    """Per run (the frame's rows): `target` (the preset's, or the final curve value of its seed's 32-true run of the
    same configuration, `baseline_id`, else of the same configuration unscaled, `design_id`), `reached` (True, False
    where its curve never reaches the target, None where there is no target or no curve to read) and
    `steps_to_target` (NaN unless reached)."""
    last = frame["curve"].map(lambda points: points[-1][1] if points else np.nan)
    fp32 = frame[(frame["setting"].astype(str) == "32-true") & (frame["status"] == "ok")]
    same_scaling = dict(zip(zip(fp32["baseline_id"], fp32["seed"]), last[fp32.index]))
    unscaled = fp32[fp32["scaling"].astype(str) == NO_SCALING]
    unscaled = dict(zip(zip(unscaled["design_id"], unscaled["seed"]), last[unscaled.index]))
    rows = []
    for experiment, baseline, design, seed, points, higher, status in zip(
            frame["experiment"], frame["baseline_id"], frame["design_id"], frame["seed"], frame["curve"],
            frame["higher_is_better"], frame["status"]):
        target = declared_target(str(experiment))
        if target is None:
            target = same_scaling.get((baseline, seed), unscaled.get((design, seed), np.nan))
        if pd.isna(target) or status != "ok" or not points:
            rows.append((target, None, np.nan))
            continue
        steps = steps_to_target(points, target, bool(higher))
        rows.append((target, steps is not None, np.nan if steps is None else steps))
    return pd.DataFrame(rows, columns=["target", "reached", "steps_to_target"], index=frame.index)
