"""`python -m bench.predict [overrides] [gpu=H100,B200]`: the speed model's answer for cells that are not trained.

    python -m bench.predict model=bert_base format=fp32,bf16 gpu=H100,B200
    python -m bench.predict model=bert_base format=fp8 scaling=per_tensor,rowwise gpu=H100,B200
    python -m bench.predict model=bert_base format=fp8 scaling=per_tensor gpu=H100 --gemms
    make predict ARGS="model=charlm format=bf16,fp8"

The overrides are `python -m bench.run`'s, comma lists swept as `-m` sweeps them; `gpu=` names shipped profiles
(bench/data/gpus/: V100, A100, H100, H200, B200; default all) or a profile's yaml path. Each cell's training step is
traced on the meta device (bench/speed/trace.py: no data trained on, no weights loaded) and predicted on every
GPU (bench/speed/model.py): compiled and eager step time, the speed-up over the same model's FP32 and bf16-mixed
(compiled), and the step's memory as the trace accounts for it. Every figure is a prediction; how far off the
model has been is in results/bench/speed_model_validation.md. Bad input exits 2 naming the valid choices.

--gemms: "does the format pay for my layers?": per Linear of each cell's step, its forward, input-gradient and
weight-gradient GEMMs (shape, kernel) and the casts the format adds, predicted compiled in bf16-mixed and in the
cell's format, with the ratio, and their sums.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tabulate import tabulate

from bench.errors import ConfigError
from bench.numerics.specs import format_spec
from bench.speed.profiles import gpu, shipped_gpus

# the speed model against every GPU figure we have (`make speed-validation` writes it, .md beside it)
SCORECARD = Path(__file__).resolve().parents[2] / "results" / "bench" / "speed_model_validation.csv"
TIMED_ALONE = ("one GEMM", "one compiled Linear")  # the scorecard's modes of a kernel timed by itself, not a step


def _split_gpus(argv: list[str]) -> tuple[list[str], list]:
    """The overrides, and the GPU profiles `gpu=` names (default: every shipped one)."""
    names = [a.split("=", 1)[1] for a in argv if a.startswith("gpu=")]
    overrides = [a for a in argv if not a.startswith("gpu=")]
    if flags := [a for a in overrides if a.startswith("-")]:
        raise ConfigError(f"{', '.join(flags)}: not an option of python -m bench.predict; valid: --gemms, --help "
                          "(and bench.run's overrides, gpu=<names>)")
    if not names:
        return overrides, list(shipped_gpus().values())
    gpus = [gpu(name) for value in names for name in value.split(",") if name]
    if not gpus:
        raise ConfigError(f"gpu= names no GPU; valid: {', '.join(shipped_gpus())} or a profile's yaml path")
    return overrides, gpus


def _configs(overrides: list[str]):
    """Every cell the overrides sweep, composed and checked as bench.run would (ConfigError for a bad one)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from bench.running.command_line import check_command_line, composition_error
    from bench.running.config import CONF_DIR, check

    check_command_line(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as e:
        raise ConfigError(f"{' '.join(overrides)}: not key=value overrides ({str(e).splitlines()[0]}); "
                          "python -m bench.predict takes bench.run's overrides and gpu=<names>") from None
    cells = [cell for batch in BasicSweeper.split_arguments(parsed, None) for cell in batch] or [[]]
    composed = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for cell in cells:
            try:
                cfg = compose("config", overrides=list(cell))
            except Exception as e:  # a value of the wrong type (train.max_steps=abc): said as bench.run says it
                raise composition_error(e) or ConfigError(f"{' '.join(cell)}: {str(e).splitlines()[0]}") from None
            check(cfg)
            composed.append((list(cell), cfg))
    return composed


_TRACES: dict[str, object] = {}


def _traced(cfg):
    """The cell's step traced at full length, once per shape a process."""
    from omegaconf import OmegaConf

    from bench.reporting.recorded_predictions import trace_key
    from bench.speed.trace import trace_cell

    key = str(trace_key(OmegaConf.to_container(cfg, resolve=True)))
    if key not in _TRACES:
        _TRACES[key] = trace_cell(cfg, full_length=True)
    return _TRACES[key]


def _baseline(cell: list[str], fmt: str, target):
    """The same cell in `fmt` (a speed-up's reference) on `target`: with its scaling method where that has a native
    path there, else with none."""
    from hydra import compose, initialize_config_dir

    from bench.running.config import CONF_DIR
    from bench.speed.model import NoNativePath, recipe_on

    kept = [o for o in cell if not o.startswith(("format=", "format."))]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for scaling in ([], ["scaling=none"]):
            reference = compose("config", overrides=[*kept, f"format={fmt}", *scaling])
            recipe = recipe_on(reference, _traced(reference), target)
            if not isinstance(recipe, NoNativePath):
                return recipe
    return recipe


def _stored_natively(cfg, trace, asked: list):
    """(the recipe, where it comes from) for the memory of a cell its GPU would emulate: a step's bytes depend on how
    the format is stored, not on which GPU stores it, so the first GPU (those asked for, then every shipped profile)
    with a native path gives them; where none has one, the format's own storage widths (`storage_recipe`)."""
    from bench.speed.model import NoNativePath, recipe_on, storage_recipe
    from bench.speed.profiles import shipped_gpus

    for target in {g.name: g for g in [*asked, *shipped_gpus().values()]}.values():  # each GPU once, asked first
        recipe = recipe_on(cfg, trace, target)
        if not isinstance(recipe, NoNativePath):
            return recipe, f"memory as {target.name} stores the format"
    return storage_recipe(cfg), "memory as the format stores it (no GPU runs it natively)"


def rows(overrides: list[str], gpus: list) -> list[dict]:
    """One row per cell and GPU."""
    from omegaconf import OmegaConf

    from bench.reporting.aggregate import describe

    cells = _configs(overrides)  # checked before the speed model is imported (torch._dynamo: seconds)
    from bench.speed.model import NoNativePath, recipe_on

    out = []
    for cell, cfg in cells:
        trace = _traced(_rank_share(cfg))  # a distributed cell's: one rank's share of the batch
        label = describe(OmegaConf.to_container(cfg.model, resolve=True))[1]
        for target in gpus:
            recipe = recipe_on(cfg, trace, target)
            row = {"model": label, "scaling": cfg.scaling.name, "also set": _also_set(cell), "GPU": target.name}
            if isinstance(recipe, NoNativePath):
                setting = format_spec(cfg.format.name).setting(cfg.format.mode)
                stored, where = _stored_natively(cfg, trace, gpus)
                memory, per_rank = _memory(cfg, trace, stored)
                out.append(row | {"setting": setting, "compiled step": "–", "eager step": "–",
                                  "vs 32-true": "–", "vs bf16-mixed": "–", "memory (MiB)": memory,
                                  "note": "; ".join(n for n in (str(recipe), where, per_rank) if n)})
                continue
            (compiled, sent), (eager, _) = (_step(cfg, trace, recipe, target, mode) for mode in (True, False))
            speedups = {"vs 32-true": _baseline(cell, "fp32", target), "vs bf16-mixed": _baseline(cell, "bf16", target)}
            speedups = {name: "–" if isinstance(base, NoNativePath) else
                        f"{_step(cfg, trace, base, target, True)[0] / compiled:.2f}×"
                        for name, base in speedups.items()}
            memory, per_rank = _memory(cfg, trace, recipe)
            out.append(row | {"setting": recipe.setting, "compiled step": f"{compiled * 1e3:.3g} ms",
                              "eager step": f"{eager * 1e3:.3g} ms", **speedups, "memory (MiB)": memory,
                              "note": "; ".join(n for n in (trace.note, recipe.note, per_rank, sent) if n)})
    return out


def _also_set(cell: list[str]) -> str:
    """What the cell sets besides its model, format and scaling method (its setting and scaling columns): the
    parallel, optimiser, master-weight and format options that tell two rows apart ("" for none). Where the configs
    and plug-ins come from (`hydra.searchpath`, `plugins`) tells none apart."""
    shown = [o.lstrip("+~") for o in cell if "=" in o]
    return ", ".join(o for o in shown if o.split("=")[0] not in ("model", "format", "scaling", "gpu", "plugins")
                     and not o.startswith("hydra."))


def _distributed(cfg):
    """The cell's `parallel` section where it trains as a job of ranks (bench.running.parallel.wanted), else None."""
    from bench.running.parallel import wanted

    return cfg.parallel if wanted(cfg) else None


def _rank_share(cfg):
    """The cell as one rank of a distributed cell trains it: rank 0's share of each batch (the largest: contiguous
    shares, bench.running.parallel.shard); the cell itself otherwise."""
    from omegaconf import OmegaConf

    if (p := _distributed(cfg)) is None or "batch_size" not in cfg.model:
        return cfg
    return OmegaConf.merge(cfg, {"model": {"batch_size": -(-cfg.model.batch_size // p.world_size)}})


def _step(cfg, trace, recipe, target, compiled: bool) -> tuple[float, str | None]:
    """A step's predicted seconds: one device's; or a rank's (FSDP2's optimiser sharded), plus the part of its
    collectives its compute does not hide, with a note of them (bench.speed.model.rank_step; its Linear weights
    gathered in FP8 where the cell asks, parallel.fp8_all_gather)."""
    from bench.speed.model import predict, rank_step

    if (p := _distributed(cfg)) is None:
        return predict(trace, recipe, target, compiled).step_s, None
    ranked = rank_step(trace, recipe, target, compiled, p, cfg.model.task.get("blocks"), fp8_gather=p.fp8_all_gather)
    if (sent := ranked.collectives) is None:
        return ranked.seconds, f"collectives not priced ({target.name}'s profile has no interconnect figures)"
    received = ", ".join(f"{kind} {n / 2**20:.3g} MiB" for kind, n in sent.received.items())
    return ranked.seconds, (f"a rank's collectives {sent.seconds * 1e3:.3g} ms over {sent.over} ({received} "
                            f"received; {_sent_as(p)}), {sent.exposed * 1e3:.3g} ms of it exposed (priced by "
                            "bandwidth alone, no per-call latency; unvalidated: docs/distributed.md)")


def out_of_sample(names: list[str], scorecard: Path = SCORECARD) -> str:
    """How far off the model has been on each GPU named, out of sample: the median |error| of the scorecard's
    validate rows, steps and speed-ups apart (kernels timed alone left out), and how many; or that it has none."""
    import pandas as pd

    if not scorecard.is_file():
        return f"no scorecard at {scorecard} (make speed-validation writes it)"
    rows = pd.read_csv(scorecard)
    rows = rows[(rows["use"] == "validate") & ~rows["mode"].isin(TIMED_ALONE)]
    rows = rows.assign(error=rows["error"].str.rstrip("%").astype(float).abs(),
                       ratio=rows["measured or published"].str.endswith("×"))
    said = []
    for name in names:
        mine = rows[rows["GPU"] == name]
        parts = [f"{what} {part['error'].median():.0f}% ({len(part)})"
                 for what, part in (("steps", mine[~mine["ratio"]]), ("speed-ups", mine[mine["ratio"]])) if len(part)]
        said.append(f"{name} {', '.join(parts)}" if parts else f"{name} never scored")
    return "median |error| out of sample, by GPU: " + "; ".join(said)


def _sent_as(p) -> str:
    """The types a distributed cell's collectives carry, as its parallel section sets them."""
    from bench.speed.model import all_reduced_in

    if p.name == "fsdp2":
        return (f"parameters gathered in {p.param_dtype}" + (", FP8 Linear weights in FP8" if p.fp8_all_gather else "")
                + f", gradients reduced in {p.reduce_dtype}")
    return f"gradients all-reduced in {all_reduced_in(p)}"


def memory_of(cfg, trace, recipe) -> dict:
    """The bytes of the cell's step by category (`step_memory`); a distributed cell's, one rank's (`rank_memory`)."""
    from bench.speed.model import fp8_gathered, rank_memory, state_shards, step_memory

    p = _distributed(cfg)
    memory = step_memory(trace, recipe, shards=state_shards(p))
    if p is None:
        return memory
    return rank_memory(memory, trace, p, cfg.model.task.get("blocks"), fp8_gathered(trace, recipe, p.fp8_all_gather))


def _memory(cfg, trace, recipe) -> tuple[str, str | None]:
    """The step's memory in MiB, and for a distributed cell (one rank's) a note saying so."""
    memory, p = memory_of(cfg, trace, recipe), _distributed(cfg)
    if p is None:
        return f"{memory['total'] / 2**20:.4g}", None
    return (f"{memory['total'] / 2**20:.4g}", f"one rank of {p.name} over {p.world_size}, its share of the batch "
            f"(its memory's communication buffers {memory['communication_buffers'] / 2**20:.3g} MiB)")


def gemm_tables(overrides: list[str], gpus: list) -> list[str]:
    """Per cell and GPU, the --gemms table: each Linear's GEMMs and casts, bf16-mixed against the cell's format."""
    cells = _configs(overrides)  # checked before the speed model is imported (torch._dynamo: seconds)
    from bench.speed.model import NoNativePath, gemm_breakdown, recipe_on

    out = []
    for cell, cfg in cells:
        trace = _traced(cfg)
        for target in gpus:
            recipe, reference = recipe_on(cfg, trace, target), _baseline(cell, "bf16", target)
            title = f"{' '.join(cell) or 'defaults'} on {target.name}"
            if isinstance(recipe, NoNativePath) or isinstance(reference, NoNativePath):
                out.append(f"{title}: {recipe if isinstance(recipe, NoNativePath) else reference}")
                continue
            parts = gemm_breakdown(trace, recipe, reference, target)
            table = [[p["linear"], p["part"], p["shape"], p["kernel"], f"{p['reference_s'] * 1e6:.1f}",
                      f"{p['format_s'] * 1e6:.1f}", _ratio(p["reference_s"], p["format_s"])] for p in parts]
            totals = [sum(p[k] for p in parts) for k in ("reference_s", "format_s")]
            table.append(["all Linears", "", "", "", f"{totals[0] * 1e6:.1f}", f"{totals[1] * 1e6:.1f}",
                          _ratio(*totals)])
            headers = ["Linear", "part", "M×K×N", "kernel", f"{reference.setting} µs", f"{recipe.setting} µs",
                       "speed-up"]
            out.append(f"{title} ({recipe.setting} against {reference.setting}, compiled):\n"
                       + tabulate(table, headers=headers, tablefmt="github"))
    return out


def _ratio(reference_s: float, format_s: float) -> str:
    return f"{reference_s / format_s:.2f}×" if format_s else "–"


COLUMNS = ["model", "setting", "scaling", "GPU", "compiled step", "eager step", "vs 32-true", "vs bf16-mixed",
           "memory (MiB)", "also set", "note"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    by_gemm = "--gemms" in argv
    try:
        overrides, gpus = _split_gpus([a for a in argv if a != "--gemms"])
        if by_gemm:
            tables = gemm_tables(overrides, gpus)
        else:
            table = rows(overrides, gpus)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if by_gemm:
        print("\n\n".join(tables))
        print("\npredicted, not measured: each GEMM priced by its shape, type and kernel (bench/speed/gemm.py), the "
              "casts as torchao's roofline counts them; speed-up > 1: the format pays for that part. Out of sample, "
              "timing one GEMM at a time on our H100, FP8 over bf16 was a loss at 69 of 88 shapes of 17.2 GFLOP or "
              "less (torch._scaled_mm's launch outweighs them; none of 436 above), which the model calls gains: a "
              "small GEMM's gain here is its GPU work alone. How far off the model has been: "
              "results/bench/speed_model_validation.md")
        return 0
    print(tabulate([[r[c] for c in COLUMNS] for r in table], headers=COLUMNS, tablefmt="github"))
    print("\npredicted, not measured: the speed model (bench/speed/model.py) on each cell's traced step; speed-ups "
          "compiled against compiled; memory as the trace accounts for a step (parameters, gradients, optimiser "
          "state, saved activations and weight copies): a sum of its tensors, not a peak, without the CUDA context, "
          "workspaces or the allocator's slack (docs/memory.md). How far off it has been: "
          "results/bench/speed_model_validation.md; " + out_of_sample(list(dict.fromkeys(r["GPU"] for r in table))))
    return 0
