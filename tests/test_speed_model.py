"""The traced step (bench/speed/trace.py) and the speed model on it (bench/speed/model.py), against hand counts,
an analytic encoder model written out here, and made-up GPU profiles."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from bench.errors import ConfigError
from bench.speed import model as speed
from bench.speed.model import Recipe, predict, recipe_on, step_memory
from bench.speed.profiles import GPU, gpu, shipped_gpus
from bench.speed.trace import trace_step
from bench.tasks.base import Task

ROOT = Path(__file__).resolve().parents[1]


def _task(model: nn.Module, batch, loss=None) -> Task:
    """A task over one made-up batch (inputs, targets), its model on the meta device."""
    return Task(model=model, train_batches=lambda epoch: iter([batch]), evaluate=lambda *a: {}, batch_size=1,
                steps_per_epoch=1, forward=lambda m, b, cast: (m(b[0]), b[1]),
                loss=loss or (lambda out, y, ce: out.float().pow(2).mean()))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_trace_counts_a_linear_a_conv_and_attention_as_by_hand():
    """Linear(64 -> 32) on 8 x 64 inputs: 2·8·64·32 FLOPs forward, as much for each gradient GEMM (its input needs
    none, so two: output and weight gradient). Conv2d(3 -> 4, 3x3) on 2 x 3 x 8 x 8 (6 x 6 out): 2·2·4·36·27 forward
    and as much for its weight gradient. Causal SDPA on (2, 4, 16, 8) q, k, v: torch's formulas, 2 GEMMs of
    2·b·h·s²·d forward, 5 backward."""
    with torch.device("meta"):
        linear = nn.Linear(64, 32)
    traced = trace_step(_task(linear, (torch.randn(8, 64, device="meta"), None)), _sgd)
    gemms = [o for o in traced.ops if o.kind == "gemm"]
    assert sorted(o.role for o in gemms) == ["grad_weight", "output"]
    assert [o.flops for o in gemms] == [2 * 8 * 64 * 32] * 2 and traced.linears == {"": (8, 64, 32)}

    with torch.device("meta"):
        conv = nn.Conv2d(3, 4, 3)
    traced = trace_step(_task(conv, (torch.randn(2, 3, 8, 8, device="meta"), None)), _sgd)
    assert sum(o.flops for o in traced.ops if o.kind == "gemm") == 2 * (2 * 2 * 4 * 36 * 27)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1, device="meta"))

        def forward(self, x):
            return nn.functional.scaled_dot_product_attention(x * self.scale, x, x, is_causal=True)

    traced = trace_step(_task(Attention(), (torch.randn(2, 4, 16, 8, device="meta"), None)), _sgd)
    attention = [o for o in traced.ops if o.kind == "attention"]
    assert len(attention) == 2 and sum(o.flops for o in attention) == (2 + 5) * 2 * 2 * 4 * 16 * 16 * 8


def _linear_trace(tokens: int = 4096, width: int = 4096):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(width, width, bias=False))
    return trace_step(_task(model, (torch.randn(tokens, width, device="meta", requires_grad=True), None)), _sgd)


def made_up_gpu(tflops: dict, tb_s: float = 1.0, **fields) -> GPU:
    """A profile of round numbers: one wave of 128 x 128 tiles covers a 4096 x 4096 output (1,024 SMs), every
    tensor-core type at its full peak."""
    defaults = {"sms": 1024, "gemm_tiles": ((128, 128),), "gemm_efficiency": {k: 1.0 for k in tflops if k != "fp32"},
                "attention_efficiency": 1.0, "efficiency_source": "made up"}
    return GPU("made-up", "Made-up", (9, 0), tflops, tb_s, "made up", **(defaults | fields))


def test_bytes_by_type_of_a_bf16_and_an_fp8_gemm():
    """One 4096 x 4096 Linear on 4096 tokens: its forward GEMM moves (in + weight) elements at the operands' width and
    the output at the type outside the GEMMs; an FP8 GEMM at the FP8 rate, its casts as torchao's roofline counts
    them (tensorwise, per operand: amax, then casts)."""
    traced = _linear_trace()
    profile = made_up_gpu({"fp32": 1.0, "bf16": 100.0, "fp8": 200.0})
    c = dataclasses.replace(speed.CONSTANTS, gemm_efficiency=0.5, memory_efficiency=1.0, gemm_latency_s=0.0,
                            kernel_floor_s=0.0, dispatch_s=0.0, autocast_dispatch_s=0.0, compiled_launch_s=0.0,
                            float8_linear_s=0.0, fp8_no_fast_accum=1.0)  # FP32's CUDA cores: no GEMM here runs on them
    n = 4096 * 4096
    bf16 = Recipe("bf16-true", "bf16", "bf16", "bf16", "all")
    fp8 = Recipe("fp8-mixed", "fp8", "bf16", "fp32", "fp8", casts="tensorwise", autocast=True)
    # three GEMMs of 2·4096³ FLOPs each: compute-bound at these rates (memory: 3·n elements of 1-2 bytes at 1 TB/s)
    assert predict(traced, bf16, profile, True, c).gemm == pytest.approx(3 * 2 * 4096**3 / 100e12)
    assert predict(traced, fp8, profile, True, c).gemm == pytest.approx(3 * 2 * 4096**3 / 200e12)
    # fp8 casts, eager (no fusion): input and output gradient: amax (2n, then a second stage moving next to nothing)
    # + one cast (2n read, 2·1n written) each; the FP32 master weight: amax (4n, and its second stage) + a cast per
    # layout (4n + 1n, twice)
    casts = speed._cast_traffic(fp8, traced, fused=False)
    assert sum(casts) == 2 * (2 * n + 4 * n) + (4 * n + 2 * 5 * n) and len(casts) == 4 + 3 + 3
    # a compiled step fuses the activations' and gradients' amax into the op before (0 bytes, one kernel floor each)
    assert sum(speed._cast_traffic(fp8, traced, fused=True)) == sum(casts) - 2 * 2 * n


def test_compiled_and_eager_compose_gpu_and_host_time_on_a_made_up_profile():
    """A step of small ops is the host's: eager = the ops' dispatches (each longer than its kernel), compiled = its
    fused kernels' launches; a large GEMM hides the host time it overlaps."""
    tiny = _linear_trace(tokens=8, width=16)
    profile = made_up_gpu({"fp32": 1e3}, tb_s=1e3)
    c = dataclasses.replace(speed.CONSTANTS, dispatch_s=1e-3, compiled_launch_s=1e-4, kernel_floor_s=1e-6,
                            gemm_latency_s=1e-6, autocast_dispatch_s=0.0)
    fp32 = Recipe("32-true", "fp32", "fp32", "fp32", "all")
    eager, compiled = predict(tiny, fp32, profile, False, c), predict(tiny, fp32, profile, True, c)
    assert eager.step_s == pytest.approx(1e-3 * len(tiny.ops))  # every op, views too, one dispatch
    non_view = [o for o in tiny.ops if o.kind != "view"]
    assert compiled.step_s == pytest.approx(1e-4 * compiled.kernels) and compiled.kernels <= len(non_view)
    assert eager.launches == pytest.approx(eager.step_s - eager.gemm - eager.memory - eager.optimizer)
    big = _linear_trace()
    slow = dataclasses.replace(profile, tflops={"fp32": 1.0})  # 1 TFLOP/s: each GEMM takes 0.137 s
    gemms = sum(o.kind == "gemm" for o in big.ops)
    assert gemms == 3 and predict(big, fp32, slow, False, c).launches == pytest.approx(1e-3 * (len(big.ops) - gemms),
                                                                                      rel=1e-3)


def test_a_model_traced_on_the_meta_device_is_built_there_drawing_no_weight_and_keeping_its_ties():
    """Initialising BERT-large on the CPU cost 3 s of each trace (make bench's speed_model section traced it ten
    times). Built on the meta device, no weight is drawn (the CPU generator is where it was) and the tied MLM head
    stays tied."""
    from transformers import BertConfig, BertForMaskedLM

    from bench.tasks.base import built_on

    before = torch.random.get_rng_state()
    model = built_on(torch.device("meta"), lambda: BertForMaskedLM(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(p.is_meta for p in model.parameters())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_the_trace_accounts_for_the_step_memory_the_runner_counts(make_cfg):
    """LeNet in FP32 and natively in bf16-mixed (autocast): the trace's account of a step (parameters, gradients,
    momentum, saved activations, autocast's weight copies) against bench/numerics/memory.py's count of a real one."""
    from bench.running.run import run_cell
    from bench.speed.trace import trace_cell

    for fmt in ("fp32", "bf16"):
        cfg = make_cfg(f"format={fmt}", "format.backend=native", "train.max_steps=1")
        counted = run_cell(cfg)["memory"]["step"]
        modelled = step_memory(trace_cell(cfg), recipe_on(cfg, trace_cell(cfg), gpu("H100")))
        assert modelled["total"] == pytest.approx(counted["total"], rel=0.001), (fmt, modelled, counted)
        assert modelled["weight_copies"] == counted["weight_copies"]


def test_the_path_predicted_is_the_runners_on_that_gpu(make_cfg):
    """A CPU-emulated cell is predicted natively on a GPU that runs its format (bf16 on an H100), and a format the
    GPU lacks, or a recipe the runner would emulate there, is no native path, with the runner's reason."""
    from bench.speed.trace import trace_cell

    traced = trace_cell(make_cfg("format=bf16"))
    assert isinstance(recipe_on(make_cfg("format=bf16", "format.backend=emulated"), traced, gpu("H100")), Recipe)
    for cfg, gpu_name, why in ((make_cfg("format=fp8", "scaling=per_tensor"), "A100", "compute capability 8.0 < 8.9"),
                               (make_cfg("format=fp8", "scaling=none"), "H100", "FP8 without per-tensor scales"),
                               (make_cfg("format=fp8", "scaling=per_tensor"), "H100", "torchao converts no Linear"),
                               (make_cfg("format=bf16"), "V100", "compute capability 7.0 < 8.0")):
        found = recipe_on(cfg, traced, gpu(gpu_name))
        assert isinstance(found, speed.NoNativePath) and why in str(found), (gpu_name, found)
    assert str(recipe_on(make_cfg("format=mxfp4"), traced, gpu("B200"))).startswith("no native path on B200")


def _analytic_gemm_flops(layers: int, hidden: int, intermediate: int, tokens: int) -> int:
    """The Linear GEMMs of a BERT encoder's step written out from its shapes: per layer Q, K, V, O (hidden x hidden)
    and the two FFN layers, three GEMMs each (forward, input and weight gradient), 2·m·k·n FLOPs each."""
    linears = [(hidden, hidden)] * 4 * layers + [(hidden, intermediate), (intermediate, hidden)] * layers
    return sum(3 * 2 * tokens * k * n for k, n in linears)


@pytest.mark.parametrize("layers, seq", [(6, 512), (12, 384)])
def test_the_traced_encoder_has_the_analytic_gemms_and_waves_only_slow_them(make_cfg, layers, seq):
    """DistilBERT's and BERT-base's shapes (random init, full-length batches of 12), compiled bf16 on an H100: the
    traced Linear GEMMs' FLOPs are the analytic count of the encoder's Linears (the head aside), and their predicted
    time lies between those FLOPs at the large-GEMM rate (full waves) and twice it (BERT's 768-wide outputs fill one
    or two waves of H100's 132 SMs and a fraction of the next; each GEMM's latency)."""
    from bench.speed.trace import trace_cell

    model = "distilbert_tiny" if layers == 6 else "bert_tiny"
    cfg = make_cfg(f"model={model}", f"model.arch.layers={layers}", "model.arch.hidden=768", "model.arch.heads=12",
                   "model.arch.intermediate=3072", "model.batch_size=12", f"model.max_length={seq}",
                   "format=bf16-true")
    traced = trace_cell(cfg, full_length=True)
    h100 = gpu("H100")
    encoder = [o for o in traced.ops if o.role and o.module.startswith(("bert.encoder", "distilbert.transformer"))]
    analytic = _analytic_gemm_flops(layers, 768, 3072, 12 * seq)
    assert sum(o.flops for o in encoder) == analytic
    assert all(o.gemm[0] * 2 * o.gemm[1] * o.gemm[2] * o.gemm[3] == o.flops for o in encoder)
    recipe = recipe_on(cfg, traced, h100)
    costs = speed._Costs(recipe, h100, speed.CONSTANTS)
    predicted = sum(costs.gemm(o, speed.gemm_kernel(recipe, traced, o), 0) for o in encoder)
    at_full_waves = analytic / (h100.tflops["bf16"] * 1e12 * h100.gemm_efficiency["bf16"])
    assert at_full_waves <= predicted <= 2 * at_full_waves


def test_gpu_profiles_are_data_with_their_sources_and_a_users_is_a_yaml_path(tmp_path):
    profiles = shipped_gpus()
    assert list(profiles) == ["V100", "A100", "H100", "H200", "B200"]
    assert all(p.source and p.tb_s > 0 and p.tflops["fp32"] > 0 for p in profiles.values())
    assert gpu("h100") == profiles["H100"]
    mine = tmp_path / "mine.yaml"
    mine.write_text(yaml.safe_dump({"name": "Mine", "device_name": "Mine", "compute_capability": [9, 0],
                                    "tflops": {"fp32": 10, "bf16": 100}, "tb_s": 1.0, "source": "made up",
                                    "sms": 10, "gemm_tiles": [[128, 128]], "gemm_efficiency": {"bf16": 0.7},
                                    "attention_efficiency": 0.3, "efficiency_source": "made up"}))
    assert gpu(str(mine)).tflops == {"fp32": 10.0, "bf16": 100.0} and gpu(str(mine)).gemm_tiles == ((128, 128),)
    with pytest.raises(ConfigError, match="unknown GPU 'H900'; known: V100, A100, H100, H200, B200"):
        gpu("H900")
    (tmp_path / "bad.yaml").write_text("name: Bad\n")
    with pytest.raises(ConfigError, match="missing device_name, compute_capability, tflops, tb_s, source, sms"):
        gpu(str(tmp_path / "bad.yaml"))
    # a profile of before the GEMM model: the new fields named, with the example to copy
    old = yaml.safe_load(mine.read_text())
    del old["gemm_tiles"], old["gemm_efficiency"]
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(ConfigError, match=r"missing gemm_tiles, gemm_efficiency \(see .*h100.yaml\)"):
        gpu(str(tmp_path / "old.yaml"))


def test_the_committed_validation_names_the_constants_the_model_uses():
    """results/bench/speed_model_validation.md is made from the constants bench/data/speed_constants.yaml holds."""
    text = (ROOT / "results" / "bench" / "speed_model_validation.md").read_text()
    for field in dataclasses.fields(speed.CONSTANTS):
        value = getattr(speed.CONSTANTS, field.name)
        shown = f"{value * 1e6:.3g} µs" if field.name.endswith("_s") else f"{value:.3g}"
        assert f"| {field.name} | {shown} |" in text
    assert not math.isnan(speed.CONSTANTS.gemm_efficiency)


def test_nvfp4_casts_count_one_weight_cast_for_16x16_tiles_and_the_rhts_extra_passes():
    """One 4096 x 4096 Linear on 4096 tokens, eager, as Transformer Engine quantises NVFP4 (low = 0.5 + 1/16 bytes):
    per operand an amax pass; the FP32 master weight one cast per layout (1 x 16: 2 x (4 + low) n) or one writing
    both (16 x 16 tiles: (4 + 2 low) n); the BF16 input and output gradient one cast writing both layouts, or with
    the RHT a row-wise cast plus the transformed copy's own amax and cast (2 + low, 2, 2 + low per n)."""
    traced = _linear_trace()
    n, low = 4096 * 4096, 0.5 + 1 / 16
    plain = Recipe("nvfp4-mixed", "nvfp4", "bf16", "fp32", "nvfp4", casts="nvfp4", autocast=True)
    weight_amax, activation_amax = 4 * n, 2 * n
    one_operand = activation_amax + (2 + 2 * low) * n
    assert sum(speed._cast_traffic(plain, traced, fused=False)) == pytest.approx(
        weight_amax + 2 * (4 + low) * n + 2 * one_operand)
    tiles = dataclasses.replace(plain, weight_tiles=True)
    assert sum(speed._cast_traffic(plain, traced, False)) - sum(speed._cast_traffic(tiles, traced, False)) == \
        pytest.approx((4 + low) * n - low * n)  # one cast of the weight fewer, one more layout written
    rht = dataclasses.replace(plain, rht=True)
    with_rht = activation_amax + (2 + low) * n + 2 * n + (2 + low) * n
    assert sum(speed._cast_traffic(rht, traced, False)) - sum(speed._cast_traffic(plain, traced, False)) == \
        pytest.approx(2 * (with_rht - one_operand))
    kept = dataclasses.replace(plain, kept=tuple(traced.linears))
    assert speed._cast_traffic(kept, traced, False) == [4096 * 4096 * (4 + 2), 4096 * 4096 * (4 + 2)]  # autocast's


def test_nvfp4_is_predicted_on_fp4_gpus_as_transformer_engine_runs_it_and_says_so(make_cfg, text_file):
    from bench.speed.trace import trace_cell

    cfg = make_cfg("model=charlm", "format=nvfp4_recipe", "model.data.source=local", f"model.data.path={text_file}",
                   "model.data.sha256=null")
    traced = trace_cell(cfg)
    found = recipe_on(cfg, traced, gpu("B200"))
    assert isinstance(found, Recipe) and found.rht and found.weight_tiles and "Transformer Engine" in found.note
    assert found.kept == ("h.3.attn.c_attn", "h.3.attn.c_proj", "h.3.mlp.c_fc", "h.3.mlp.c_proj", "lm_head")
    assert "compute capability >= 10.0" in str(recipe_on(cfg, traced, gpu("H100")))
    assert speed.predictions(cfg, traced, [gpu("B200")])["B200"]["note"] == speed.NVFP4_NOTE


def test_autocast_costs_the_host_its_dispatch_on_every_eager_op():
    """A launch-bound step (a tiny Linear), eager, on a made-up profile: bf16-mixed under autocast costs each op
    autocast_dispatch_s more host time than the same types without autocast (bf16-true), views included; compiled,
    autocast costs the host nothing more (its casts are kernels of the graph)."""
    tiny = _linear_trace(tokens=8, width=16)
    profile = made_up_gpu({"fp32": 1e3, "bf16": 1e3}, tb_s=1e3)
    c = dataclasses.replace(speed.CONSTANTS, dispatch_s=1e-3, autocast_dispatch_s=5e-4, kernel_floor_s=1e-9,
                            gemm_latency_s=1e-9, compiled_launch_s=1e-4)
    mixed = Recipe("bf16-mixed", "bf16", "bf16", "bf16", "all", autocast=True)
    true = Recipe("bf16-true", "bf16", "bf16", "bf16", "all")
    extra = predict(tiny, mixed, profile, False, c).step_s - predict(tiny, true, profile, False, c).step_s
    casts = len(speed._cast_traffic(mixed, tiny, fused=False))  # autocast's own casts: kernels, dispatched too
    assert extra == pytest.approx(5e-4 * len(tiny.ops) + 1.5e-3 * casts)
    assert predict(tiny, mixed, profile, True, c).launches == pytest.approx(
        predict(tiny, true, profile, True, c).launches + 1e-4 * casts, rel=1e-4)


def test_a_full_length_batch_larger_than_the_fixture_is_traced_at_its_size(make_cfg):
    """BERT-large's pre-training micro-batch (256 x 128) on the shipped QA fixture, which holds fewer examples than
    one such batch: the traced forward GEMMs still see 256 x 128 tokens (a batch of one is the template)."""
    from bench.speed.trace import trace_cell

    cfg = make_cfg("model=bert_tiny", "model.batch_size=256", "model.max_length=128")
    traced = trace_cell(cfg, full_length=True)
    assert {m for m, _, _ in traced.linears.values()} == {256 * 128}


def test_a_char_lm_is_traced_without_its_text_on_stand_in_text_of_its_vocabulary(make_cfg, tmp_path, monkeypatch):
    """bench.predict reads no data: where Tiny Shakespeare is not here, the char-LM is traced on stand-in text with
    its 65 characters, which gives the step a local copy of other text with the same characters gives (same model,
    same batch shapes), and the note says so; other text that is not here is still refused by name."""
    from bench.speed.trace import trace_cell
    from bench.tasks.charlm import SHAKESPEARE_CHARACTERS

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    small = ["model.arch.layers=1", "model.arch.embedding=32", "model.arch.block_size=16", "model.batch_size=4"]
    stand_in = trace_cell(make_cfg("model=charlm", *small))
    assert stand_in.note.startswith("traced on stand-in text with Tiny Shakespeare's 65 characters")
    text = tmp_path / "other.txt"
    text.write_text(" ".join(SHAKESPEARE_CHARACTERS[::-1] * 40))
    local = trace_cell(make_cfg("model=charlm", *small, "model.data.source=local", f"model.data.path={text}",
                                "model.data.sha256=null"))
    assert local.note is None
    assert (stand_in.parameters, stand_in.flops(), stand_in.linears) == (local.parameters, local.flops(), local.linears)
    with pytest.raises(ConfigError, match="could not download"):
        trace_cell(make_cfg("model=charlm", *small, "model.data.sha256=null",
                            "model.data.url=http://127.0.0.1:9/other.txt"))  # refused at once, with or without internet


@pytest.mark.parametrize("model", ["charlm", "bert_mlm_tiny"])
def test_a_model_traced_on_the_meta_device_keeps_its_tied_parameters(make_cfg, model):
    """Moving a model to the meta device gave each module its own parameter: the char-LM's head counted apart from its
    embedding, and BERT's MLM head's bias apart from its decoder's (which unit scaling then refused). Traced, the
    model holds as many parameters as on the CPU."""
    from bench.speed.trace import _traceable, trace_cell
    from bench.tasks import build_task

    cfg = make_cfg(f"model={model}", "model.arch.block_size=16", "model.batch_size=4")
    traced = trace_cell(cfg)
    on_cpu = build_task(_traceable(cfg)[0].model, torch.device("cpu"), 0).model  # the text (or its stand-in) traced
    assert traced.parameters == sum(p.numel() for p in on_cpu.parameters())
    if model == "bert_mlm_tiny":
        assert trace_cell(make_cfg(f"model={model}", "scaling=unit", "model.arch.block_size=16")).parameters


def test_the_h100_gemm_curve_is_scored_out_of_sample_each_gemm_at_the_models_gemm_time(tmp_path):
    """Our H100's GEMM curve (bench.tools.gpu_gemms curve) is validate data, not fit data: every GEMM shape x kernel
    a time row and every FP8 kernel a speed-up row, each compiled Linear likewise; a GEMM row's prediction is
    gemm_time of its shape at its kernel's rate (bf16 out). Declared `fit` instead, its rows leave every goal's count
    (so a refit could not hide behind them), and the committed scorecard carries them."""
    from bench.speed.gemm import gemm_time, rate
    from bench.tools import speed_validation as validation

    keys = ("ours_h100_gemms", "ours_h100_compiled_linears")
    rows = validation.with_uses(validation.published_rows(("gemm_curve",)))
    assert {r.source for r in rows} == set(keys) and {r.use for r in rows} == {"validate"}
    assert sum(r.source == keys[0] for r in rows) == 131 * (5 + 4)  # 131 shapes: a time per kernel, 4 speed-ups
    assert sum(r.source == keys[1] for r in rows) == 8 * (3 + 2)

    h100, c = gpu("H100"), speed.CONSTANTS
    factors = {"fp8_no_fast_accum": c.fp8_no_fast_accum, "fp8_rowwise": c.fp8_rowwise}
    shape = [r for r in rows if r.model == "GEMM M,K,N = 8192,4096,1024" and r.unit == "s"]
    assert [r.what for r in shape] == list(validation.GEMM_KERNELS)
    for r in shape:
        kernel = validation.GEMM_KERNELS[r.what]
        expected = gemm_time(1, 8192, 4096, 1024, kernel, h100, flops_per_s=rate(h100, kernel.element, factors, kernel),
                             bytes_per_s=h100.tb_s * 1e12 * c.memory_efficiency,
                             operand_bytes=speed.ELEMENT_BYTES[kernel.element], output_bytes=2,
                             latency_s=c.gemm_latency_s).seconds
        assert r.predict(c) == pytest.approx(expected, rel=1e-12)
    assert len({round(r.predict(c), 12) for r in shape}) > 2  # the kernels' factors reach the prediction

    picked = [r for r in rows if r.model in ("GEMM M,K,N = 8192,4096,1024", "Linear 8192→8192 on 8192 tokens")]
    declared = validation.sources()
    switched = tmp_path / "figures.yaml"
    switched.write_text(yaml.safe_dump({"sources": declared | {k: declared[k] | {"use": "fit"} for k in keys}}))
    scored = validation.against_goals(validation.table(picked, c))
    assert scored[0].startswith("- speed-ups (validate, 6 rows)") and any("one GEMM timed alone" in s for s in scored)
    as_fit = validation.against_goals(validation.table(validation.with_uses(picked, validation.sources(switched)), c))
    assert as_fit[0].startswith("- speed-ups (validate, 0 rows)") and not any("timed alone" in s for s in as_fit)

    committed = (ROOT / "results" / "bench" / "speed_model_validation.md").read_text()
    assert all(f"  - {k}: " in committed for k in keys) and "- one GEMM timed alone, ours (validate" in committed


def test_a_reused_recorded_prediction_reads_as_a_recomputed_one():
    """An archive keeps records with sorted keys; a table regenerated from them must read the same whether a record's
    own prediction is reused (its speed model unchanged) or recomputed (a later one), key order included."""
    import json

    from bench.reporting import archive
    from bench.reporting.recorded_predictions import predicted
    from bench.speed.model import fingerprint

    record = archive.read(ROOT / "results" / "tables" / "default" / archive.ARCHIVE)[0][0]
    h100 = (gpu("H100"),)
    computed = predicted(record | {"predicted_by": "an older model"}, h100)
    stored = json.loads(json.dumps(computed, sort_keys=True))  # as an archive holds it
    reused = predicted(record | {"predicted": stored, "predicted_by": fingerprint()}, h100)
    assert json.dumps(reused) == json.dumps(computed)


def test_per_op_recomputation_runs_each_blocks_forward_again_but_its_saved_products_and_attention(make_cfg):
    """torchtitan's per-op SAC, as bench.speed.trace.with_op_recomputation prices it: two blocks of three bias-free
    Linears and a ReLU between each (an mm and an elementwise op apiece): each block's forward again in the backward
    but its first and third matrix products (saved), so one product and the ReLUs a block; nothing outside the
    blocks; and the step priced longer by just those ops."""
    from bench.speed.trace import with_op_recomputation

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (nn.Linear(64, 64, bias=False) for _ in range(3))

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Sequential(Block(), Block()))
    traced = trace_step(_task(model, (torch.randn(32, 64, device="meta"), None)), _sgd)
    again = with_op_recomputation(traced, "1")
    added = again.ops[len([o for o in traced.ops if o.phase == "forward"]):][:len(again.ops) - len(traced.ops)]
    assert len(again.ops) > len(traced.ops) and all(o.phase == "backward" for o in added)
    assert {o.module for o in added} == {"1.0.b", "1.1.b"} | {"1.0", "1.1"}  # the products of b; the ReLUs
    assert [o.module for o in added if o.kind == "gemm"] == ["1.0.b", "1.1.b"]
    assert [o for o in again.ops if o not in added] == traced.ops
    h100 = gpu("H100")
    recipe = recipe_on(make_cfg("format=bf16"), traced, h100)
    extra = predict(again, recipe, h100, False).step_s - predict(traced, recipe, h100, False).step_s
    alone = dataclasses.replace(traced, ops=added)
    assert extra == pytest.approx(predict(alone, recipe, h100, False).step_s - predict(
        dataclasses.replace(traced, ops=[]), recipe, h100, False).step_s, rel=1e-9)


def test_importing_torchao_on_a_cpu_says_nothing_that_reads_as_a_failure_and_other_lines_still_pass():
    """A newcomer's `bench.predict model=bert_base` began with "Failed to load .../torchao/_C_mxfp8....so" and
    torch's deprecation notice about torchao's enums, and an int8 optimiser's run with torchao's "Detected no
    triton" (2026-11-30): bench's filter drops those, nothing else."""
    import logging
    import subprocess
    import sys

    said = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); import bench, torchao.float8, "
                           "torchao.prototype.mx_formats, torchao.kernel.intmm"],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert said.returncode == 0 and not [words for words in ("Failed to load", "register_constant", "no triton")
                                         if words in said.stderr], said.stderr
    noise, = logging.getLogger("torchao").filters
    line = logging.LogRecord("torchao", logging.WARNING, "x", 1, "Failed to load %s", ("/a/torchao/_C_x.so",), None)
    assert noise.filter(line) == torch.cuda.is_available()
    other = logging.LogRecord("torchao", logging.WARNING, "x", 1, "Failed to load /a/elsewhere.so", None, None)
    assert noise.filter(other)


def test_a_trace_moved_to_the_cpu_says_why_in_the_errors_first_sentence_whole():
    from bench.speed.trace import _cpu_note

    torchs = NotImplementedError("The register_meta function for torch.nonzero() raises unimplemented by default, as a "
                                 "correct data-independent implementation does not exist. This implementation "
                                 "returns a fake value, assuming all elements of the tensor are non-zero.")
    assert _cpu_note(torchs).endswith("as a correct data-independent implementation does not exist)")
    assert len(_cpu_note(RuntimeError("x" * 500))) < 300


def test_an_uncached_checkpoint_is_traced_at_its_published_size_its_vocabulary_included(make_cfg):
    """bert_base's checkpoint is not cached here: its step is traced at bert-base-uncased's published architecture,
    randomly initialised, with the embedding of its 30,522 pieces (the shipped tokenizer has 303). The QA model's
    parameters are then transformers' BertForQuestionAnswering's at that size: 108,893,186 (without the vocabulary,
    85,684,994, and every all-reduce and memory figure 21% short)."""
    from bench.reporting.predict_cells import _traced

    trace = _traced(make_cfg("model=bert_base"))
    assert "published architecture" in trace.note and trace.parameters == 108_893_186


def test_an_embedding_smaller_than_the_tokenizer_is_refused(make_cfg):
    from bench.tasks import build_task

    cfg = make_cfg("model=bert_tiny", "model.arch.vocab_size=100")
    with pytest.raises(ConfigError, match=r"model.arch.vocab_size=100 is under the tokenizer's 303 pieces"):
        build_task(cfg.model, torch.device("cpu"), 0)


def test_every_committed_cuda_bench_json_names_a_shipped_gpu_and_holds_rows():
    """The scorecard reads every results/bench/cuda-*.json as `make bench` wrote it (speed_validation.measured_rows):
    a file of another shape there fails `make bench`'s speed-model section and the slow suite (a pytest summary
    committed as JSON did, 2026-11-30)."""
    import json

    from bench.tools import speed_validation as validation

    assert validation.MEASURED
    for path in validation.MEASURED:
        data = json.loads(path.read_text())
        assert isinstance(data.get("rows"), list), path.name
        assert any(data.get("env", {}).get("device_name", "").startswith(g.device_name)
                   for g in shipped_gpus().values()), path.name
