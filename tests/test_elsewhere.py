"""format.elsewhere: FP8 and the block formats with everything outside their converted GEMMs in BF16 autocast, as
torchao's float8 training, Transformer Engine and DeepSeek-V3 run them; FP32 there (the default) as before."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bench.numerics.precision import Precision, PrecisionError
from bench.running.config import check
from bench.running.identity import run_id

CPU = torch.device("cpu")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_an_emulated_gemm_under_bf16_autocast_is_the_fp32_gemm_of_its_operands_handed_on_in_bf16(fmt):
    """The operands already hold the format's values: the GEMM runs on them in FP32 and writes BF16 (an FP8 GEMM's
    output under autocast), never a BF16 GEMM that would round them again (NVFP4's FP32 tensor scale does not fit)."""
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(64, 32), torch.randn(8, 64)
    plain = Precision.of(fmt, CPU, mode="mixed", backend="emulated").prepare(layer)
    with torch.no_grad():
        reference = plain(x)
    elsewhere = Precision.of(fmt, CPU, mode="mixed", backend="emulated", elsewhere="bf16")
    with torch.no_grad(), elsewhere.autocast():
        y = plain(x)  # the same emulated layer, under the BF16 autocast format.elsewhere=bf16 adds
    assert y.dtype == torch.bfloat16 and torch.equal(y, reference.to(torch.bfloat16))


def test_bf16_elsewhere_runs_the_rest_of_a_cell_in_bf16_and_says_so(make_cfg):
    from bench.reporting.aggregate import summarise, to_frame
    from bench.reporting.tables import precision_table
    from bench.running.run import run_cell

    cells = {}
    for elsewhere in ("fp32", "bf16"):
        cfg = make_cfg("model=bert_tiny", "format=fp8", "scaling=per_tensor", f"format.elsewhere={elsewhere}",
                       "train.max_steps=3", f"experiment_name=elsewhere_{elsewhere}")  # composed outside a sweep
        run_cell(cfg)
        cells[elsewhere] = json.loads((Path(cfg.results_dir) / cfg.cell / "result.json").read_text())
    bf16 = cells["bf16"]["env"]["precision"]
    assert (bf16["elsewhere"], bf16["label"]) == ("bf16", "fp8-mixed (bf16 elsewhere) (emulated)")
    assert cells["fp32"]["env"]["precision"]["label"] == "fp8-mixed (emulated)"
    assert cells["bf16"]["metrics"]["final_train_loss"] != cells["fp32"]["metrics"]["final_train_loss"]
    frame = to_frame([r | {"_dir": None} for r in cells.values()])
    table = precision_table(summarise(frame))
    assert sorted(table["setting"]) == ["fp8-mixed (bf16 elsewhere) †", "fp8-mixed †"]


def test_elsewhere_fp32_is_the_run_it_always_was_and_bf16_the_recipes_default(make_cfg):
    """Before 0.2.0 fp8 and the block formats ran FP32 elsewhere (no key, or null); now their yaml says bf16."""
    configs = {value: make_cfg("format=fp8", *([f"format.elsewhere={value}"] if value else []))
               for value in (None, "null", "fp32", "bf16")}
    ids = {value: run_id(OmegaConf.to_container(cfg, resolve=True)) for value, cfg in configs.items()}
    assert ids["null"] == ids["fp32"] != ids["bf16"] == ids[None]
    assert configs["fp32"].cell == configs["null"].cell == "default/lenet/fp8-mixed/none/seed0"
    assert configs[None].cell == configs["bf16"].cell == "default/lenet/fp8-mixed/none/seed0,format.elsewhere=bf16"
    for fmt in ("fp8", "mxfp8", "mxfp6", "mxfp4", "nvfp4"):
        assert make_cfg(f"format={fmt}").format.elsewhere == "bf16"


@pytest.mark.parametrize("overrides, message", [
    (["format=bf16", "format.elsewhere=bf16"], "format.elsewhere=bf16 applies to the formats of the GEMM operands only "
                                                "(fp8, mxfp8, mxfp6, mxfp4, nvfp4, nvfp4_recipe), not to format=bf16"),
    (["format=fp8", "format.elsewhere=fp16"], "format.elsewhere='fp16' is not valid; valid: fp32, bf16"),
])
def test_elsewhere_is_refused_where_it_means_nothing(make_cfg, overrides, message):
    with pytest.raises(PrecisionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(make_cfg(*overrides))
