"""A run that trained without a NaN but did not learn as its siblings did is told apart (bench/running/learning.py):
on made-up curves at each edge of the rule, on the committed records of the two runs that stalled, by the sweep that
writes the verdict into the records, and in the tables, which show the cell with and without it."""

import gzip
import json
from pathlib import Path

import pytest

from bench.running.learning import judge, learning_summary, stalled_verdict
from bench.running.record import read_record, write_json_atomic

TABLES = Path(__file__).resolve().parents[1] / "results" / "tables"


def _curve(early: float, final: float, steps: int = 100, every: int = 5, start: float = 5.0) -> list:
    """A made-up training curve: `start` at step 0, `early` up to 15% of the steps, `final` over the last tenth,
    a straight line between."""
    def loss(step: int) -> float:
        at = step / steps
        if step == 0:
            return start
        if at <= 0.15:
            return early
        return final if at >= 0.9 else early + (final - early) * (at - 0.15) / 0.75

    return [[step, loss(step)] for step in range(0, steps, every)]


def _summary(early: float, final: float, **kw) -> dict:
    return learning_summary(_curve(early, final, **kw), kw.get("steps", 100))


def test_the_summary_reads_the_early_window_and_the_last_tenth():
    curve = [[0, 9.0], [5, 4.0], [10, 3.0], [15, 2.0], [20, 7.0], [85, 1.5], [90, 1.0], [95, 0.5]]
    summary = learning_summary(curve, 100)
    assert summary["early_loss"] == 3.0 and summary["early_points"] == 3  # median of steps 5, 10, 15
    assert summary["final_loss"] == 0.75 and summary["final_points"] == 2  # mean of steps 90, 95
    coarse = learning_summary([[0, 9.0], [40, 4.0], [80, 2.0]], 100)  # no logged step in 5-15%: the nearest to 10%
    assert coarse["early_loss"] == 9.0 and coarse["final_loss"] == 2.0
    assert learning_summary([[0, float("nan")]], 10) is None and learning_summary([], 10) is None
    assert learning_summary([[0, 2.0], [5, float("inf")], [9, 1.0]], 10)["final_loss"] == 1.0  # non-finite left out


@pytest.mark.parametrize("run, siblings, stalled", [
    ((2.30, 2.30), [(0.76, 0.47), (0.62, 0.19)], True),  # LeNet at chance: its end above the siblings' 10% point
    ((2.20, 0.70), [(0.76, 0.47), (0.62, 0.19)], True),  # just past the line (0.69): stalled
    ((0.90, 0.68), [(0.76, 0.47), (0.62, 0.19)], False),  # just inside it: merely a worse seed
    ((0.60, 0.52), [(1.49, 0.29), (0.95, 0.26)], False),  # learned fast, then less (LeNet fp16 unit seed 2)
    ((3.30, 3.45), [(3.20, 3.20), (3.29, 3.29)], False),  # a cell that never learned: nothing to fall behind
    ((3.30, 3.45), [(3.20, 2.90), (3.29, 3.29)], False),  # the siblings' median drop, 0.15, is under a tenth of 3.25
    ((2.30, 2.30), [(0.76, 0.47)], None),  # one sibling cannot say which of the two is odd
])
def test_the_rule_at_each_of_its_edges(run, siblings, stalled):
    verdict = stalled_verdict(_summary(*run), [_summary(*s) for s in siblings])
    assert (verdict if verdict is None else verdict["stalled"]) is stalled
    if verdict is not None:
        assert verdict["siblings"] == len(siblings) and verdict["final_loss"] == pytest.approx(run[1])


def _flagged(folder: str) -> list[tuple]:
    """The runs of a committed folder the aggregator's rule flags: (format, scaling, norm, seed)."""
    from bench.reporting.aggregate import load_sources, to_frame

    records, _ = load_sources([str(TABLES / folder / "records.jsonl.gz")])
    frame = to_frame(records)
    flagged = frame[frame["stalled"].eq(True)]
    undecided = frame[(frame["status"] == "ok") & frame["stalled"].isna()]
    assert undecided.empty  # every finished run of these folders has a curve and two siblings
    return sorted((str(r.setting), str(r.scaling), r.model_label.split("-norm")[0].rsplit(" ", 1)[-1], r.seed)
                  for r in flagged.itertuples())


def test_the_two_stalled_runs_of_the_committed_folders_are_flagged_and_nothing_else():
    """LeNet bf16-mixed with unit scaling, seed 0, at chance (10%, loss 2.30); the post-norm char-LM in FP8 with unit
    scaling, seed 1, at its unigram loss (3.35 nats); no other run of either folder."""
    assert _flagged("default") == [("bf16-mixed", "unit", "(digits)", 0)]
    assert _flagged("unit_scaling_charlm") == [("fp8-mixed", "unit", "post", 1)]


def test_a_sweep_writes_each_runs_verdict_into_its_record(tmp_path):
    """judge(), which the sweeper calls once every cell has ended: three seeds of one cell and one of another."""
    def run(name: str, seed: int, early: float, final: float, scaling: str = "unit") -> Path:
        run_dir = tmp_path / name
        write_json_atomic(run_dir / "result.json", {
            "status": "ok", "reason": None, "config": {"experiment_name": "t", "seed": seed, "cell": name,
                                                        "model": {"name": "lenet", "data": {"source": "digits"}},
                                                        "format": {"name": "bf16"},
                                                        "scaling": {"name": scaling}},
            "env": {"precision": {}}, "metrics": {}, "timing": {"steps": 100}, "memory": {}, "numerics": {}})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": loss}) + "\n"
                                                       for s, loss in _curve(early, final)))
        return run_dir

    dirs = [run("seed0", 0, 2.3, 2.3), run("seed1", 1, 0.76, 0.47), run("seed2", 2, 0.62, 0.19),
            run("other", 0, 2.3, 2.3, scaling="none")]
    assert judge(dirs) == ["seed0"]
    verdicts = {d.name: read_record(d / "result.json")["numerics"]["stalled"] for d in dirs}
    assert verdicts["seed0"]["stalled"] and verdicts["seed0"]["siblings"] == 2
    assert verdicts["seed0"]["siblings_early_loss"] == pytest.approx(0.69)
    assert not verdicts["seed1"]["stalled"] and not verdicts["seed2"]["stalled"]
    assert verdicts["other"] is None  # no siblings: undecided, said so
    before = (dirs[1] / "result.json").stat().st_mtime_ns
    assert judge(dirs) == ["seed0"] and (dirs[1] / "result.json").stat().st_mtime_ns == before  # unchanged: unwritten


def test_the_tables_show_a_cell_with_and_without_its_stalled_run(tmp_path):
    """The default folder's bf16-mixed unit cell: with seed 0 (10.00%), and without it, seeds 1 and 2 (92.78% and
    95.00%: mean 93.89, sample std 1.57), by hand from its records."""
    from bench.reporting.report import main as aggregate

    records = [json.loads(line) for line in gzip.open(TABLES / "default" / "records.jsonl.gz", "rt")]
    values = sorted(r["metrics"]["test_accuracy"] for r in records
                    if (r["config"]["format"]["name"], r["config"]["scaling"]["name"]) == ("bf16", "unit"))
    assert values[0] == 0.1 and [round(100 * v, 2) for v in values[1:]] == [92.78, 95.0]
    assert aggregate([str(TABLES / "default" / "records.jsonl.gz"), "--out", str(tmp_path), "--no-plots"]) == 0
    row = next(line for line in (tmp_path / "default" / "precision.md").read_text().splitlines()
               if "| bf16-mixed " in line and "| unit " in line)
    assert "65.93 ± 48.45 (n=3)" in row and "[1 stalled¶; without: 93.89 ± 1.57 (n=2)]" in row
    assert "without stalled runs:" in row and "¶ stalled:" in (tmp_path / "default" / "precision.md").read_text()
