"""The XLA path (device=xla) on a real XLA device: torch_xla's CPU device (PJRT_DEVICE=CPU), which runs the graph
path a TPU runs. `make test-xla` makes its own environment (torch_xla and the torch it needs) and runs these;
elsewhere they skip. What only a TPU can show (its MXU's bf16 products, its speed) is not claimed here."""

import json
import os
from pathlib import Path

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")

import torch_xla.debug.metrics as met

from bench.numerics.precision import Precision
from bench.running import device as devices
from bench.running.run import build_cell, preflight, run_cell
from bench.running.train import train
from tests.conftest import interrupted_at_checkpoint_then_resumed

pytestmark = pytest.mark.xla
assert os.environ.get("PJRT_DEVICE") == "CPU", "make test-xla runs these on XLA's CPU device (PJRT_DEVICE=CPU)"


def _record(cfg) -> dict:
    run_cell(cfg)
    return json.loads((Path(cfg.results_dir) / cfg.cell / "result.json").read_text())


def test_device_selection_finds_the_xla_device():
    assert devices.select_device("xla").type == "xla"
    assert devices.select_device("auto").type == "xla"  # no CUDA here; torch_xla importable


def test_the_device_matrix_tpu_row_is_what_the_real_xla_device_decides():
    """The matrix simulates a TPU; on a real XLA device Precision must decide the same for every setting."""
    from bench.tools.matrix import decide, settings

    device = devices.select_device("xla")
    for fmt, mode in settings():
        real = Precision.of(fmt, device, mode=mode, backend="auto")
        assert (real.backend, real.why) == decide("TPU (torch_xla)", fmt, mode, "none"), (fmt, mode)
    assert Precision.of("bf16", device, mode="mixed", backend="auto").backend == "native"
    assert Precision.of("fp16", device, mode="mixed", backend="auto").backend == "emulated"


@pytest.mark.parametrize("model", ["lenet", "bert_tiny"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "bf16-true"])
def test_a_cell_trains_on_xla_and_its_record_says_so(make_cfg, model, fmt):
    record = _record(make_cfg("device=xla", f"model={model}", f"format={fmt}", "train.max_steps=6",
                              "train.log_every=3"))
    assert record["status"] == "ok", record.get("traceback")
    assert record["env"]["device_type"] == "xla"
    assert record["env"]["precision"]["backend"] == ("native" if fmt != "fp32" else "native")
    assert record["timing"]["step_time_method"] == "wall_clock_between_log_steps"
    assert record["timing"]["steps"] == 6 and record["timing"]["step_median_s"] > 0
    assert record["timing"]["conditions"]["cpu_model"]


def _counts() -> tuple[int, int]:
    """XLA's (graphs compiled, transfers from the device to the host) so far in this process."""
    return ((met.metric_data("CompileTime") or (0,))[0], (met.metric_data("TransferFromDeviceTime") or (0,))[0])


def run_metered(make_cfg, *overrides) -> tuple[dict, int]:
    """Train a cell on XLA and charge XLA's compiles and transfers to what made them: step k (its forward,
    backward and optimiser step, and on log steps the read that follows), an epoch's end, or the end.
    Returns ({charge: (compiles, transfers)}, steps trained, the transfers a bare forward and backward of the model
    makes by itself)."""
    cfg = make_cfg("device=xla", *overrides, f"train.max_steps={STEPS}", f"train.log_every={LOG_EVERY}",
                   "train.epochs=50")
    _, precision = preflight(cfg)
    cell = build_cell(cfg, precision)
    task, marks, started = cell.task, [], [-1]
    before = _counts()[1]
    precision.telemetry.sampling = False  # as on an ordinary step
    with precision.autocast():  # the model's own reads: a bare forward and backward of one batch, outside the loop
        outputs, targets = task.forward(task.model, next(iter(task.train_batches(0))), precision.inputs)
        task.compute_loss(outputs, targets).backward()
    devices.end_step(precision.device)
    task.model.zero_grad(set_to_none=True)
    models_own = _counts()[1] - before
    batches = task.train_batches

    def metered_batches(epoch):
        for batch in batches(epoch):
            started[0] += 1
            marks.append((started[0], _counts()))
            yield batch
        marks.append((f"end of epoch {epoch}", _counts()))

    task.train_batches = metered_batches
    outcome = train(task, precision, cell.scaler, cell.optimizer, cell.schedule, cfg.train, precision.device,
                    lambda row: None, count_memory=False)
    marks.append(("end", _counts()))
    charged = {}
    for (label, before), (_, after) in zip(marks, marks[1:]):
        charged[label] = (after[0] - before[0], after[1] - before[1])
    return charged, outcome.steps, models_own


STEPS, LOG_EVERY = 30, 10
CELLS = {"lenet-fp32": ["model=lenet"], "lenet-bf16-dynamic": ["model=lenet", "format=bf16", "scaling=dynamic"],
         "lenet-bf16-true": ["model=lenet", "format=bf16-true"], "bert_tiny-bf16": ["model=bert_tiny", "format=bf16"],
         "distilbert_tiny-fp32": ["model=distilbert_tiny"]}


@pytest.mark.parametrize("cell", CELLS)
def test_after_warm_up_no_step_compiles_a_new_graph_and_only_log_steps_read_the_device(make_cfg, cell):
    """Step 0 compiles the training step with its telemetry, step 1 without, the first log read its own graph;
    after the first log interval no step compiles again, and only log steps, epoch ends and the end read the
    device (text batches keep a fixed length on XLA: bench/tasks/text.py)."""
    charged, steps, models_own = run_metered(make_cfg, *CELLS[cell])
    print(cell, f"model's own transfers per forward: {models_own}", charged)
    assert steps == STEPS
    steps_charged = {k: v for k, v in charged.items() if isinstance(k, int) and k < steps}  # k = steps: the end
    recompiled = {k: c for k, (c, _) in steps_charged.items() if k > LOG_EVERY and c}
    assert recompiled == {}, f"graphs compiled after warm-up: {charged}"
    read = {k: t for k, (_, t) in steps_charged.items() if k % LOG_EVERY and t != models_own}
    assert read == {}, f"host transfers on ordinary steps beyond the model's own {models_own}: {charged}"
    assert models_own == (1 if "bert" in cell else 0)  # transformers' mask builder: padding_mask.all(), each forward


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_the_first_steps_memory_on_xla_is_what_it_is_on_the_cpu(make_cfg, fmt):
    """Modelled memory counts the format: XLA's lazy tensors (no storage) are counted as the CPU's, category by
    category, but for what XLA's kernels save: its max-pool backward selects from the input again and keeps no
    int64 indices."""
    counted = {}
    for device in ("cpu", "xla"):
        record = _record(make_cfg(f"device={device}", "model=lenet", f"format={fmt}", "train.max_steps=1",
                                  f"experiment_name=memory_{device}"))
        assert record["status"] == "ok", record.get("traceback")
        counted[device] = record["memory"]["step"]
    pool_indices = 32 * (6 * 14 * 14 + 16 * 5 * 5) * 8  # int64 argmax of both max-pools, per batch of 32
    assert counted["xla"] == counted["cpu"] | {"activations": counted["cpu"]["activations"] - pool_indices,
                                               "total": counted["cpu"]["total"] - pool_indices}


def test_an_interrupted_cell_resumes_on_xla_to_the_weights_of_a_straight_run(make_cfg, monkeypatch):
    overrides = ["device=xla", "model=lenet", "format=bf16", "scaling=dynamic", "train.max_steps=40",
                 "train.checkpoint_every=20", "train.keep_checkpoint=true"]
    straight = make_cfg(*overrides)
    first = _record(straight)
    assert first["status"] == "ok", first.get("traceback")
    reference = torch.load(Path(straight.results_dir) / straight.cell / "checkpoint.pt", weights_only=False)
    interrupted = make_cfg(*overrides, "experiment_name=interrupted")
    record = interrupted_at_checkpoint_then_resumed(interrupted, monkeypatch, 20)
    assert record["status"] == "ok" and record["resumed_from"] == {"checkpoint": "checkpoint.pt", "step": 20}
    resumed = torch.load(Path(interrupted.results_dir) / interrupted.cell / "checkpoint.pt", weights_only=False)
    assert all(v.device.type == "cpu" for v in resumed["model"].values())  # loadable without torch_xla
    assert all(torch.equal(reference["model"][k], resumed["model"][k]) for k in reference["model"])


def _bf16_layer_on_xla_and_emulated(layer: str, bias: bool):
    torch.manual_seed(0)
    make = (lambda: torch.nn.Linear(256, 64, bias=bias)) if layer == "linear" else (
        lambda: torch.nn.Conv2d(6, 16, 5, bias=bias))
    module, x = make(), torch.randn(32, 256) if layer == "linear" else torch.randn(8, 6, 14, 14)
    device = devices.select_device("xla")
    gemm = torch.nn.functional.linear if layer == "linear" else torch.nn.functional.conv2d
    with torch.autocast("xla", dtype=torch.bfloat16):
        module, x_xla = module.to(device), x.to(device)
        on_xla, product = module(x_xla).cpu(), gemm(x_xla, module.weight).cpu()  # the GEMM alone, in bf16
    module = module.cpu()
    emulated = Precision.of("bf16", torch.device("cpu"), mode="mixed", backend="emulated").prepare(make())
    emulated.load_state_dict(module.state_dict())
    with torch.no_grad():
        ours = emulated(x)
    return on_xla, ours, product, module.bias


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_xlas_bf16_gemm_is_the_emulated_tpu_bf16_bit_for_bit(layer):
    """TPU's rule as our emulation computes it on the CPU (bf16 operands, FP32 accumulation, one rounding of the
    result to bf16) is what XLA computes for the same op under bf16 autocast: bit for bit on this AMD EPYC. Two
    FP32 GEMM libraries may sum in other orders, which can move a result across a bf16 rounding boundary, so the
    test allows a rare one-rounding difference. XLA:CPU is not a TPU's MXU: this says where the roundings are, not
    that a TPU sums in the same order."""
    on_xla, ours, _, _ = _bf16_layer_on_xla_and_emulated(layer, bias=False)
    assert on_xla.dtype == torch.bfloat16
    one_rounding = torch.finfo(torch.bfloat16).eps * ours.abs()
    assert ((on_xla.float() - ours).abs() <= one_rounding).all()
    assert float((on_xla.float() == ours).float().mean()) > 0.99


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_xla_adds_the_bias_after_rounding_the_product_where_the_emulation_adds_it_before(layer):
    """With a bias XLA's graph rounds the product to bf16 and then adds the bf16 bias (two roundings); our
    emulation, like cuBLAS's epilogue, adds it in FP32 and rounds once. Measured here: about a quarter of the
    outputs differ by one bf16 rounding (docs/tpu.md); whether a TPU's fused bias add keeps FP32 only a TPU shows."""
    on_xla, ours, product, bias = _bf16_layer_on_xla_and_emulated(layer, bias=True)
    shape = (1, -1) if layer == "linear" else (1, -1, 1, 1)
    b = bias.detach().bfloat16().reshape(shape)
    assert torch.equal(on_xla, product + b)  # XLA: the GEMM rounded to bf16, then the bias added in bf16
    differ = float((on_xla.float() != ours).float().mean())
    print(layer, f"outputs that differ: {differ:.1%}")
    assert 0.05 < differ < 0.5


def test_emulated_fp8_with_per_tensor_scaling_trains_on_xla(make_cfg):
    """It runs, though not at XLA's speed: the bit-level rounding (copysign, dtype views) has no XLA lowering in
    torch_xla 2.9 and falls back to the CPU, a transfer each way per rounded tensor (docs/tpu.md)."""
    record = _record(make_cfg("device=xla", "model=lenet", "format=fp8", "scaling=per_tensor", "train.max_steps=6",
                              "train.log_every=3"))
    assert record["status"] == "ok", record.get("traceback")
    assert record["env"]["precision"]["backend"] == "emulated" and record["metrics"]["final_train_loss"] < 3
    scales = record["numerics"]["quantisation"]
    assert scales  # per-tensor telemetry read on the sampled steps


def test_make_doctor_on_the_xla_device():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "bench.tools.doctor"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert "| native " in rows["bf16-mixed"] and "| pass " in rows["bf16-mixed"]
    assert "| emulated " in rows["fp16-mixed"]
    assert done.stdout.startswith("device: xla, XLA:CPU")
