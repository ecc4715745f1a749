"""`make chaos`: a small CPU sweep under fire, re-run until complete, then every record checked.

    python -m bench.tools.chaos [--results DIR] [--seed N]

- the grid (8 LeNet cells, checkpointing every 25 steps) is SIGKILLed at random moments, again and
  again, and re-launched each time: finished cells must be skipped, killed ones resumed;
- after the first kill one finished record is corrupted: the next launch must report and re-run it;
- one cell raises (its checkpoint's weights file is truncated, as by a broken download) and one diverges
  (lr 1e8);
- disk faults, in a results folder of their own: a full disk (a 2-cell sweep whose every write past 64 KiB
  fails, RLIMIT_FSIZE; and, as root, into a 64 KiB tmpfs) must stop each cell with one line and end with the
  summary and exit 1, leaving no record and no temporary file, and complete once there is space; a truncated
  checkpoint and another run's checkpoint must be moved aside and their cells complete, the record saying so;
then: every cell has exactly one valid record with the expected status, and no checkpoint or temporary
file is left behind. Prints the counts; exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.running.record import RecordError, read_record

ROOT = Path(__file__).resolve().parents[2]
GRID = ["format=fp32,fp16,bf16,fp8", "scaling=none,dynamic", "train.max_steps=600", "train.checkpoint_every=25"]
DIVERGING = ["format=tf32", "model.optimizer.lr=1e8", "train.max_steps=200"]
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def truncated_checkpoint(directory: Path) -> Path:
    """A BERT checkpoint directory whose weights file is cut in half (a broken download): loading it raises."""
    from transformers import BertConfig, BertForQuestionAnswering, BertTokenizer

    from bench.data import DATA_DIR

    tokenizer = BertTokenizer(vocab=str(DATA_DIR / "vocab.txt"))
    BertForQuestionAnswering(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=64)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return directory


def raising_cell(directory: Path) -> list[str]:
    """Overrides of a cell that raises while it builds its model (recorded as failed, not a config error)."""
    return ["model=bert_tiny", "model.pretrained=true", f"model.hub_name={truncated_checkpoint(directory)}",
            "train.max_steps=5"]


def file_size_limit(limit: int | None):
    """A subprocess preexec_fn that makes every write past `limit` bytes of a file fail with EFBIG, in the process
    and in every process it starts, as a full quota does (Python ignores SIGXFSZ); None for no limit."""
    return None if limit is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def launch(results: Path, overrides: list[str], file_limit: int | None = None) -> subprocess.Popen:
    """The sweep as users start it (python -m bench.run), optionally under a file-size limit."""
    cmd = [sys.executable, "-m", "bench.run", "-m", "experiment_name=chaos", f"results_dir={results}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=os.environ | ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=file_size_limit(file_limit))


DISK_GRID = ["format=fp32,bf16", "train.max_steps=40", "train.checkpoint_every=20", "train.keep_checkpoint=true"]


def _tiny_tmpfs() -> Path | None:
    """A 64 KiB tmpfs (a really full disk), where this process may mount one (root); else None."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return None
    where = Path(tempfile.mkdtemp(prefix="bench-chaos-full-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True).returncode:
        where.rmdir()
        return None
    return where


def _full_disk_stops_each_cell_cleanly(results: Path, file_limit: int | None, problems: list[str], how: str) -> None:
    proc = launch(results, DISK_GRID, file_limit)
    _, err = proc.communicate()
    left = [p for p in results.rglob("*") if p.name == "result.json" or p.name.endswith(".tmp")]
    if proc.returncode != 1 or err.count("storage error:") != 2 or "2 failed without a record" not in err \
            or "Traceback" in err or left:
        problems.append(f"full disk ({how}): exit {proc.returncode}, left {left}, said: {err[-1500:]}")


def disk_faults(results: Path, counts: Counter) -> list[str]:
    """A full disk, a truncated checkpoint and another run's checkpoint; the problems found."""
    problems: list[str] = []
    _full_disk_stops_each_cell_cleanly(results, 64 * 2**10, problems, "writes past 64 KiB fail")
    counts["full disk"] += 1
    if (mount := _tiny_tmpfs()) is not None:
        try:
            _full_disk_stops_each_cell_cleanly(mount / "runs", None, problems, "a 64 KiB tmpfs")
            counts["full disk"] += 1
        finally:
            subprocess.run(["umount", str(mount)], check=False)
            mount.rmdir()
    if launch(results, DISK_GRID).wait() != 0:  # space again: both cells complete
        problems.append("the full-disk grid did not complete once there was space")
    cells = sorted(p.parent for p in results.rglob("result.json"))
    if len(cells) != 2:
        return problems + [f"full-disk grid: {len(cells)} records, expected 2"]
    truncated, foreign = cells
    for cell in cells:
        (cell / "result.json").unlink()
    mine, theirs = (truncated / "checkpoint.pt").read_bytes(), (foreign / "checkpoint.pt").read_bytes()
    (truncated / "checkpoint.pt").write_bytes(mine[: len(mine) // 2])
    (truncated / "checkpoint.previous.pt").write_bytes(theirs)  # its fallback: another run's
    (foreign / "checkpoint.pt").write_bytes(mine)  # another run's, and no fallback
    (foreign / "checkpoint.previous.pt").unlink()
    if launch(results, DISK_GRID).wait() != 0:
        problems.append("cells with unusable checkpoints did not complete")
    for cell, expected in ((truncated, 2), (foreign, 1)):
        record = json.loads((cell / "result.json").read_text())
        discarded = record.get("discarded_checkpoints", [])
        if record["status"] != "ok" or len(discarded) != expected or record["resumed_from"] is not None:
            problems.append(f"{cell}: {record['status']}, discarded {discarded}, resumed from {record['resumed_from']}")
        counts["checkpoints moved aside"] += len(discarded)
    return problems


def run_under_fire(results: Path, rng: random.Random, counts: Counter) -> None:
    """Launch the grid, kill it at a random moment, repeat until a launch finishes by itself."""
    while True:
        counts["launches"] += 1
        proc = launch(results, GRID)
        deadline = time.time() + rng.uniform(8.0, 25.0)  # a launch spends ~5 s importing before it trains
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            counts["kills"] += 1
            if counts["corrupted"] == 0:
                finished = sorted(results.rglob("result.json"))
                if finished:
                    victim = rng.choice(finished)
                    victim.write_text(victim.read_text()[: len(victim.read_text()) // 2])
                    counts["corrupted"] += 1
                    print(f"corrupted {victim}", file=sys.stderr)
            continue
        if proc.returncode != 0:
            raise SystemExit(f"the grid sweep exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        return


def run_grid_once_more_skips_everything(results: Path) -> bool:
    proc = launch(results, GRID)
    _, err = proc.communicate()
    return proc.returncode == 0 and "(8 skipped as already recorded)" in err


def check(results: Path) -> tuple[Counter, list[str]]:
    """Status counts and every problem found: one valid record per cell, nothing left behind."""
    problems, statuses = [], Counter()
    cells = sorted({p.parent for p in results.rglob("result.json")} | {p.parent for p in results.rglob("*.tmp")})
    for cell in cells:
        found = list(cell.glob("result.json"))
        if len(found) != 1:
            problems.append(f"{cell}: {len(found)} records")
            continue
        try:
            statuses[read_record(found[0])["status"]] += 1
        except RecordError as e:
            problems.append(str(e))
        leftovers = [p.name for p in cell.iterdir() if p.name.startswith("checkpoint.") or p.name.endswith(".tmp")]
        if leftovers:
            problems.append(f"{cell}: left behind {leftovers}")
    expected = Counter({"ok": 8, "failed": 1, "diverged": 1})
    if statuses != expected:
        problems.append(f"statuses {dict(statuses)}, expected {dict(expected)}")
    return statuses, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="where the chaos records go (default: a fresh temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = args.results or Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    rng, counts, start = random.Random(args.seed), Counter(), time.time()
    run_under_fire(results, rng, counts)
    raising = raising_cell(Path(tempfile.mkdtemp(prefix="bench-chaos-checkpoint-")))
    for overrides, expected_rc in ((raising, 1), (DIVERGING, 0)):
        for _ in range(2):  # the second launch must skip the recorded cell and report the same outcome
            proc = launch(results, overrides)
            proc.wait()
            counts["launches"] += 1
            if proc.returncode != expected_rc:
                raise SystemExit(f"{overrides} exited {proc.returncode}, expected {expected_rc}")
    statuses, problems = check(results)
    if not run_grid_once_more_skips_everything(results):
        problems.append("a complete grid was not skipped when launched again")
    problems += disk_faults(results.with_name(results.name + "-disk"), counts)
    print(f"chaos: {counts['launches']} launches, {counts['kills']} SIGKILLs, {counts['corrupted']} corrupted record; "
          f"records: {statuses['ok']} ok, {statuses['diverged']} diverged, {statuses['failed']} failed; "
          f"disk: {counts['full disk']} full-disk sweeps, {counts['checkpoints moved aside']} checkpoints moved aside; "
          f"{len(problems)} problems; {time.time() - start:.0f} s ({results})")
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    if not problems and args.results is None:
        shutil.rmtree(results)
        shutil.rmtree(results.with_name(results.name + "-disk"), ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
