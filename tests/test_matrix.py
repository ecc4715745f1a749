"""The device matrix: what format.backend=auto decides on every device a cluster may have, checked against the
rules written out by hand, kept equal to the README's table, and no cell of any grid refused on any device."""

import itertools

import pytest
from omegaconf import OmegaConf

from bench.numerics.scaling_methods import combining_with
from bench.numerics.specs import FORMAT_SPECS
from bench.running.config import check, preset_sweeper
from bench.running.run import build_precision
from bench.tools.matrix import PROFILES, decide, elsewhere_emulated, markdown, settings, simulated
from tests.conftest import CONF

FORMATS_DOC = CONF.parent / "docs" / "formats.md"


def expected(profile: str, fmt: str, scaling: str, torchaos_mx_recipe: bool = False) -> tuple[str, str]:
    """The rules, independently of bench/running/device.py: (backend, a phrase the reason must contain)."""
    kind, flags, capability, torchao = PROFILES[profile]
    if fmt == "fp32":
        return "native", "FP32 is native everywhere"
    if fmt in ("mxfp6", "mxfp4", "nvfp4", "nvfp4_recipe"):
        return "emulated", "emulated on every device"
    if fmt == "mxfp8":  # torchao's MXFP8Linear on >= 10.0, for its recipe (E4M3 gradients, rceil or floor) only
        if kind != "cuda" or capability < (10, 0):
            return "emulated", {"cpu": "not on cpu", "xla": "not on xla", "cuda": "< 10.0"}[kind]
        if not torchao:
            return "emulated", "torchao has no MXFP8Linear"
        return ("native", ">= 10.0") if torchaos_mx_recipe else ("emulated", "needs format.gradients=fp8_e4m3")
    if fmt == "fp8":
        if kind != "cuda" or capability < (8, 9):
            return "emulated", {"cpu": "no fp8 compute path", "xla": "bf16 only", "cuda": "< 8.9"}[kind]
        if not torchao:
            return "emulated", "torchao is not installed"
        if scaling == "block":  # Transformer Engine is not a dependency
            return "emulated", "Float8BlockScaling is not wired in"
        return (("native", ">= 8.9") if scaling in ("per_tensor", "rowwise", "rowwise_with_gw_hp")
                else ("emulated", "exists only as emulation"))
    if kind == "cpu":
        fast = {"tf32": False, "fp16": False,  # torch's CPU fp16 is slower than emulation, AMX-FP16 or not
                "bf16": bool({"avx512_bf16", "amx_bf16"} & set(flags))}[fmt]
    elif kind == "cuda":
        fast = capability >= {"tf32": (8, 0), "fp16": (7, 0), "bf16": (8, 0)}[fmt]
    else:
        fast = fmt == "bf16"
    if fast and scaling == "per_tensor":
        return "emulated", "per-tensor scaling of"
    return ("native", "") if fast else ("emulated", "")


@pytest.mark.parametrize("profile", list(PROFILES))
def test_every_decision_follows_the_rules(profile):
    for (fmt, mode), scaling in ((setting, s) for setting in settings()
                                 for s in combining_with(FORMAT_SPECS[setting[0]])):
        backend, why = decide(profile, fmt, mode, scaling)
        want, reason = expected(profile, fmt, scaling)
        assert (backend, reason in why) == (want, True), (profile, fmt, mode, scaling, backend, why)


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("scale_mode", ["rceil", "floor"])
def test_mxfp8_in_torchaos_recipe_is_native_where_torchao_has_it(profile, scale_mode):
    backend, why = decide(profile, "mxfp8", "mixed", "none", gradients="fp8_e4m3", scale_mode=scale_mode)
    want, reason = expected(profile, "mxfp8", "none", torchaos_mx_recipe=True)
    assert (backend, reason in why) == (want, True), (profile, backend, why)


def test_the_formats_doc_shows_the_table_the_code_makes():
    assert markdown() in FORMATS_DOC.read_text(), \
        "docs/formats.md: the device matrix is stale; paste `python -m bench.tools.matrix`"


def _grids() -> dict[str, list[dict]]:
    """Every cell of the default `make sweep` grid and of every preset, as {group: option} choices."""
    makefile = (CONF.parent / "Makefile").read_text()
    default = {key: next(line.split("?=")[1].strip() for line in makefile.splitlines()
                         if line.startswith(var) and "?=" in line)
               for key, var in (("format", "FORMATS"), ("scaling", "SCALINGS"))}
    grids = {"default": [default | {"model": "lenet"}]}
    settings = {"default": [{}]}
    for preset in sorted((CONF / "experiment").glob("*.yaml")):
        # as Hydra composes it: a preset may take its settings from another's (nvfp4_recipe_2000)
        sweeper = OmegaConf.to_container(preset_sweeper(preset.stem))
        grids[preset.stem] = [{k: str(v) for k, v in sweeper["params"].items()} | {"experiment": preset.stem}]
        settings[preset.stem] = [dict(item.split("=", 1)
                                      for item in (s["overrides"] if isinstance(s, dict) else s).split())
                                 for s in sweeper.get("settings") or []] \
            or [{}]  # hydra.sweeper.settings: override sets (or {overrides, label, bits}) crossed with the params
    cells = {}
    for name, (grid,) in grids.items():
        keys = list(grid)
        cells[name] = [dict(zip(keys, values)) | setting
                       for values in itertools.product(*(str(grid[k]).split(",") for k in keys))
                       for setting in settings[name]]
    return cells


UNCHECKED_NUMBERS = ("seed", "model.optimizer.lr", "model.optimizer.min_lr")


@pytest.mark.parametrize("every_cell", [
    False,  # `make sweep`'s grid and each preset's first cell: composing a cell costs 0.17 s, the whole lot 50 s
    pytest.param(True, marks=pytest.mark.slow)])
def test_no_cell_of_any_grid_is_refused_on_any_device(make_cfg, every_cell):
    assert {(c["format"], c["scaling"]) for c in _grids()["unit_scaling_charlm"]} == {
        ("fp16", "none"), ("fp16", "static"), ("fp16", "unit"), ("fp32", "none"), ("fp32", "unit"),
        ("fp8", "dynamic"), ("fp8", "per_tensor"), ("fp8", "unit")}  # its settings, not the defaults
    composed, seen = [], set()
    for name, cells in _grids().items():
        for cell in cells if every_cell or name == "default" else cells[:1]:
            # the seed and the learning rates change no check and no plan: one cell of each (composing is the cost)
            key = (name, *sorted((k, v) for k, v in cell.items() if k not in UNCHECKED_NUMBERS))
            if key in seen:
                continue
            seen.add(key)
            cfg = make_cfg(*(f"{k}={v}" for k, v in cell.items()))
            check(cfg)
            composed.append((name, cell, cfg))
    assert len(composed) > (100 if every_cell else 40)
    for profile in PROFILES:
        with simulated(profile) as device:
            for _name, _cell, cfg in composed:
                build_precision(cfg, device)  # raises PrecisionError for a refused cell


def test_the_matrix_says_where_autocasts_own_gemms_are_emulated():
    """format.elsewhere=bf16 leaves some layers to BF16 autocast; only a CPU without BF16 units emulates their
    convolutions and matmuls (bench/numerics/autocast.py), and the line under the table says so."""
    emulated = [profile for profile in PROFILES if elsewhere_emulated(profile) is not None]
    assert emulated == ["CPU without 16-bit units"]
    assert "emulated on the others" in markdown().splitlines()[-1]


def test_a_cell_emulated_on_a_device_that_has_its_format_says_the_device_has_it():
    """`auto` emulates FP8 without per-tensor scales on an H100; the reason ended "(compute capability 9.0 >= 8.9)",
    which read as a contradiction (a newcomer's trial, 2026-11-30): it is the device's support, and says so."""
    backend, why = decide("H100 (9.0) with torchao", "fp8", "mixed", "none")
    assert backend == "emulated" and why.endswith("(this device has fp8: compute capability 9.0 >= 8.9)"), why


def test_the_matrix_shows_a_plugins_format_named_as_bench_run_names_it(tmp_path):
    """`python -m bench.tools.matrix plugins=[amd_fp8]` printed the built-in table alone, the plug-in ignored (a
    newcomer's trial, 2026-11-30); any other argument exits 2 naming the one it takes."""
    import os
    import subprocess
    import sys

    plugin = CONF.parent / "tests" / "plugin"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(plugin), str(CONF.parent)])}

    def matrix(*args):
        return subprocess.run([sys.executable, "-m", "bench.tools.matrix", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    shown = matrix("plugins=[amd_fp8]")
    assert shown.returncode == 0, shown.stderr[-2000:]
    header = shown.stdout.splitlines()[0]
    assert header.endswith("| nvfp4_recipe-mixed | fp8fnuz-mixed |"), header
    for refused in (matrix("format=fp8"), matrix("plugins=[amd_fp9]")):
        assert refused.returncode == 2 and "config error:" in refused.stderr and "Traceback" not in refused.stderr
    assert "the one argument is plugins=[module,...]" in matrix("format=fp8").stderr
