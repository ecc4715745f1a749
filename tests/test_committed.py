"""Committed tables come with their records (bench/reporting/archive.py) and regenerate from them alone
(bench/reporting/committed.py, `make tables`); the index of results/tables is written from the records."""

import filecmp
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.reporting import aggregate, archive, committed
from bench.running.run import run_cell

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT / "results" / "tables"


def test_the_default_tables_regenerate_from_their_records_identically(tmp_path):
    """Every table, csv and SVG of results/tables/default is what its records.jsonl.gz makes today (PNGs, raster
    renderings of the same figures as the SVGs, are left out: their pixels may depend on the machine's rasteriser)."""
    folder = tmp_path / "default"
    shutil.copytree(TABLES / "default", folder,
                    ignore=shutil.ignore_patterns("*.png", "*.svg", "*.csv", "*.md", "*.tex"))
    written, problems = committed.regenerate(folder)
    assert written and not problems
    made = sorted(p.name for p in folder.iterdir() if p.suffix != ".png")
    assert made == sorted(p.name for p in (TABLES / "default").iterdir() if p.suffix != ".png")
    differing = [name for name in made if not filecmp.cmp(folder / name, TABLES / "default" / name, shallow=False)]
    assert differing == [], f"results/tables/default drifted from its records in {differing}: run `make tables`"


def test_the_index_is_what_the_records_say():
    assert (TABLES / committed.INDEX).read_text() == committed.index(TABLES), "run `make tables`"


def test_every_committed_folder_is_in_the_index_and_says_whether_it_has_records():
    text = (TABLES / committed.INDEX).read_text()
    for folder in committed.folders(TABLES):
        name = folder.relative_to(TABLES).as_posix()
        assert f"[{name}]({name}/)" in text
    assert "[records.jsonl.gz](default/records.jsonl.gz)" in text


def test_committed_records_stay_small():
    sizes = sum(p.stat().st_size for p in TABLES.rglob(archive.ARCHIVE))
    assert 0 < sizes < 20 * 2**20


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    from hydra import compose, initialize_config_dir

    results = tmp_path_factory.mktemp("runs")
    for fmt in ("fp32", "bf16"):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"results_dir={results}", "model=lenet", f"format={fmt}",
                                               "train.max_steps=20", "train.log_every=5"])
        run_cell(cfg)
    return results


def test_an_archive_holds_each_record_and_its_loss_curve_and_reads_back_the_same(two_runs, tmp_path):
    records, problems = aggregate.load_directory(two_runs)
    assert len(records) == 2 and not problems
    path = archive.write(records, tmp_path / archive.ARCHIVE)
    again = archive.write(records[::-1], tmp_path / "again" / archive.ARCHIVE)
    assert path.read_bytes() == again.read_bytes()  # the same records make the same bytes
    back, problems = archive.read(path)
    assert not problems
    by_cell = {r["_dir"]: r for r in back}
    for r in records:
        cell = r["config"]["cell"]
        # the curve read back is the one the run logged (its metrics.jsonl, read here without the aggregator)
        logged = [json.loads(line) for line in (two_runs / cell / "metrics.jsonl").read_text().splitlines()]
        losses = [[e["step"], e["loss"]] for e in logged if "loss" in e and "step" in e]
        assert by_cell[cell]["_losses"] == [[s, pytest.approx(x, rel=1e-6)] for s, x in losses]
        assert [s for s, _ in losses] == [0, 5, 10, 15]  # its log steps
        assert {k: v for k, v in by_cell[cell].items() if not k.startswith("_")} == \
            {k: v for k, v in r.items() if not k.startswith("_")}


def test_a_damaged_archive_line_is_named_and_the_rest_kept(two_runs, tmp_path):
    records, _ = aggregate.load_directory(two_runs)
    path = archive.write(records, tmp_path / archive.ARCHIVE)
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    path.write_bytes(gzip.compress((lines[0] + "\n" + lines[1][:100] + "\n").encode()))
    back, problems = archive.read(path)
    assert len(back) == 1 and problems == [f"{path}:2: malformed line (JSONDecodeError: "
                                           + problems[0].split("JSONDecodeError: ", 1)[1]]
    path.write_bytes(b"not gzip")
    assert archive.read(path)[1][0].startswith(f"{path}: unreadable archive")


@pytest.mark.slow  # ~13 s; the committed folders' own regeneration tests run by default
def test_keep_records_makes_a_folder_that_regenerates_itself_and_is_indexed(two_runs, tmp_path):
    out = tmp_path / "tables"
    made = subprocess.run([sys.executable, "-m", "bench.aggregate", str(two_runs), "--out", str(out),
                           "--keep-records", "--no-plots"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert made.returncode == 0, made.stderr
    folder = out / "default"
    first = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert archive.ARCHIVE in first and "precision.md" in first
    assert "32-true" in made.stdout and "bf16-mixed" in made.stdout  # the headline table, printed
    again = subprocess.run([sys.executable, "-m", "bench.reporting.committed", "--root", str(out), "--no-plots"],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == first  # from the records alone, the same tables
    index = (out / committed.INDEX).read_text()
    row = next(line for line in index.splitlines() if line.startswith("| [default]"))
    record = json.loads(next(two_runs.rglob("result.json")).read_text())
    assert "2 (2 ok)" in row and record["env"]["device_name"] in row and record["env"]["torch_version"] in row
    assert "`make committed-tables`" in row and record["env"]["git_commit"][:7] in row
    assert record["env"]["started_at"][:10] in row  # the date the cells ran


def test_aggregate_reads_an_archive_as_a_source(two_runs, tmp_path):
    records, _ = aggregate.load_directory(two_runs)
    path = archive.write(records, tmp_path / "x" / archive.ARCHIVE)
    made = subprocess.run([sys.executable, "-m", "bench.aggregate", str(path), "--out", str(tmp_path / "t"),
                           "--no-plots"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "t" / "default" / "precision.md").exists()


def test_the_index_says_when_records_ran_on_uncommitted_code(two_runs, tmp_path):
    """env.git_changes: a record made from a working tree with changes is indexed as its commit plus changes, not as
    the commit alone (whose code it did not run)."""
    runs = tmp_path / "runs"
    shutil.copytree(two_runs, runs)
    for path in runs.rglob("result.json"):
        record = json.loads(path.read_text())
        record["env"]["git_changes"] = True
        path.write_text(json.dumps(record))
    out = tmp_path / "tables"
    made = subprocess.run([sys.executable, "-m", "bench.aggregate", str(runs), "--out", str(out), "--keep-records",
                           "--no-plots"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert made.returncode == 0, made.stderr
    assert committed.main(["--root", str(out), "--index-only"]) == 0
    row = next(line for line in (out / committed.INDEX).read_text().splitlines() if line.startswith("| [default]"))
    assert f"({record['env']['git_commit'][:7]} + uncommitted changes)" in row
    assert isinstance(json.loads(next(two_runs.rglob("result.json")).read_text())["env"]["git_changes"], bool)


def test_a_device_subfolder_is_remade_into_itself_not_over_the_cpu_folder(two_runs, tmp_path):
    """A folder under a device's subfolder (results/tables/h100/<experiment>) is indexed with the command that
    remakes it there: `make committed-tables` without COMMITTED would write over results/tables/<experiment>."""
    out = tmp_path / "tables"
    made = subprocess.run([sys.executable, "-m", "bench.aggregate", str(two_runs), "--out", str(out / "h100"),
                           "--keep-records", "--no-plots"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert made.returncode == 0, made.stderr
    shutil.copytree(out / "h100" / "default", out / "h100" / "old")
    (out / "h100" / "old" / archive.ARCHIVE).unlink()  # a folder made before records were kept
    assert committed.main(["--root", str(out), "--index-only"]) == 0
    rows = {line.split("]")[0][3:]: line for line in (out / committed.INDEX).read_text().splitlines()
            if line.startswith("| [")}
    assert "made on the device `h100` names by `make committed-tables COMMITTED=results/tables/h100`" \
        in rows["h100/default"]
    assert "remake on the device `h100` names: `make committed-tables COMMITTED=results/tables/h100`" \
        in rows["h100/old"]
    command = committed.make_command("smoke", "h100")
    dry = subprocess.run(command.split()[:2] + ["-n", *command.split()[2:]], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert "--experiment smoke --out results/tables/h100 --keep-records" in dry.stdout, dry.stdout + dry.stderr


@pytest.mark.parametrize("experiment", ["nvfp4_recipe", "nvfp4_recipe_2000"])
def test_the_nvfp4_ablation_pairs_each_cell_with_bf16_seed_by_seed_as_its_records_say(tmp_path, experiment):
    """The ablation (at 1,000 and at 2,000 iterations) remade from the committed records (as the committed one), its
    differences against ones computed here from the records alone: each cell picked by its format node (not by the
    table's selectors), its validation loss minus BF16's of the same seed, averaged; and each "full − X" minus the
    full recipe's, seed by seed."""
    import pandas as pd

    folder = tmp_path / experiment
    folder.mkdir()
    shutil.copy(TABLES / experiment / archive.ARCHIVE, folder / archive.ARCHIVE)
    committed.regenerate(folder, plots_too=False)
    assert filecmp.cmp(folder / "ablation.csv", TABLES / experiment / "ablation.csv", shallow=False)
    records, problems = archive.read(folder / archive.ARCHIVE)
    assert not problems and len(records) == 36

    def losses(name, rounding="nearest", **switches):
        chosen = {}
        for r in records:
            f = r["config"]["format"]
            wanted = {"rht": False, "weight_blocks": "1x16", "keep_high_precision": ["head"], "scale_rule": "te",
                      "sr_bits": 8 if rounding == "stochastic" else None} | switches
            if f["name"] == name and f["rounding"] == rounding and all(f.get(k) == v for k, v in wanted.items()):
                chosen[r["config"]["seed"]] = r["metrics"]["val_loss"]
        return chosen

    bf16 = losses("bf16", keep_high_precision=None, scale_rule="torchao")
    full = losses("nvfp4_recipe", "stochastic", rht=True, weight_blocks="16x16",
                  keep_high_precision=["head", "last_blocks:1"])
    table = pd.read_csv(folder / "ablation.csv").set_index("cell")
    for cell, mine, reference, column in (
            ("NVFP4 plain", losses("nvfp4"), bf16, "Δ vs BF16"),
            ("plain + stochastic gradients", losses("nvfp4", "stochastic"), bf16, "Δ vs BF16"),
            ("full recipe", full, bf16, "Δ vs BF16"),
            ("full - RHT", losses("nvfp4_recipe", "stochastic", weight_blocks="16x16",
                                  keep_high_precision=["head", "last_blocks:1"]), full, "Δ vs full recipe"),
            ("full recipe, torchao's scale rule",
             losses("nvfp4_recipe", "stochastic", rht=True, weight_blocks="16x16", scale_rule="torchao",
                    sr_bits=None, keep_high_precision=["head", "last_blocks:1"]), full, "Δ vs full recipe")):
        assert sorted(mine) == sorted(reference) == [0, 1, 2], cell
        difference = sum(mine[s] - reference[s] for s in reference) / 3
        assert table.loc[cell, column].startswith(f"{difference:+.3f} ["), (cell, difference)
    assert table.loc["BF16", "Δ vs BF16"] == "baseline" and table.loc["full recipe", "Δ vs full recipe"] == "baseline"
    assert table.loc["NVFP4 plain", "Δ vs full recipe"] == "–"


def test_a_folder_a_tool_made_names_that_tool_not_a_preset_that_does_not_exist():
    assert committed.make_command("gpu_report", "nvidia-h100-80gb-hbm3").startswith("make gpu-report")
    assert committed.make_command("umup_fp8") == "make committed-tables EXPERIMENT=umup_fp8"


def test_a_tables_notes_explain_only_the_marks_its_rows_carry():
    """A folder's cells decide which notes its tables may need, but each table keeps only those whose mark (†, ‡,
    ¶, §, °) one of its rows shows: a newcomer's precision.md explained a § none of its rows had (2026-11-30)."""
    from bench.reporting.table_cells import ROW_MARKS

    root = Path(__file__).resolve().parents[1] / "results" / "tables"
    explained = 0
    for table in root.glob("*/*.md"):
        lines = table.read_text().splitlines()
        rows = "".join(line for line in lines if line.startswith("|"))
        for mark in (line[:1] for line in lines if line[:1] in ROW_MARKS):
            assert mark in rows, f"{table}: explains {mark}, which none of its rows shows"
            explained += 1
    assert explained > 20


def test_a_record_made_in_another_checkout_is_traced_with_this_checkouts_shipped_data():
    """The committed block_formats records name /work/snap/bench/data/...: traced as they are, their step could not
    be (no such file here) and a new speed model left their predicted columns empty."""
    from bench.data import DATA_DIR
    from bench.running.identity import with_shipped_data_here

    elsewhere = {"model": {"vocab": "/work/snap/bench/data/vocab.txt", "files": ["/x/bench/data/no_such_file"]},
                 "seed": 0}
    assert with_shipped_data_here(elsewhere) == {"model": {"vocab": str(DATA_DIR / "vocab.txt"),
                                                           "files": ["/x/bench/data/no_such_file"]}, "seed": 0}


def test_a_table_of_distributed_cells_says_what_their_predicted_step_prices():
    """A DDP or FSDP2 row's predicted step is one device's step of the whole batch (its record's): the table says so,
    and a table without such rows does not (a newcomer read LeNet's 198 µs for none, ddp and fsdp2 as a rank's)."""
    tables = Path(__file__).resolve().parents[1] / "results/tables"
    said = "a distributed cell's (parallel=ddp or fsdp2) predicted step is one device's step of the whole batch"
    assert said in (tables / "distributed_precision/precision.md").read_text()
    assert said not in (tables / "default/precision.md").read_text()
