"""Memory as the format stores it (bench/numerics/memory.py) and FLOPs per step, against hand counts and against native
runs: on CPU, bf16 autocast and model.to(bfloat16) run natively, so an emulated bf16 run's model can be held
to what the native run really holds, category by category."""

import pytest

from bench.running.run import run_cell

B = 32  # LeNet's batch
LENET_PARAMS = (6 * 25 + 6) + (16 * 6 * 25 + 16) + (400 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10)
WEIGHTS = 6 * 25 + 16 * 6 * 25 + 400 * 120 + 120 * 84 + 84 * 10
# What LeNet's forward saves for backward, per example: (elements, is it a 16-bit value in a 16-bit run)
MATMUL_INPUTS = [1 * 32 * 32, 6 * 14 * 14, 400, 120, 84]  # conv1, conv2, fc1, fc2, fc3 (fc2/fc3: ReLU outputs)
RELU_OUTPUTS = [6 * 28 * 28, 16 * 10 * 10]  # the two conv ReLUs (also the max-pools' inputs)
POOL_INDICES = [6 * 14 * 14, 16 * 5 * 5]  # int64
LOSS = 10 * 4 + 8  # log-softmax output (FP32 in every run) and the int64 target, per example
LOSS_SCALAR = 4  # nll_loss's total weight


def step_memory(make_cfg, tmp_path, *overrides) -> dict:
    # a cell's place does not name overrides outside a Hydra run
    results = tmp_path / "-".join(overrides).replace("=", "_")
    record = run_cell(make_cfg("model=lenet", "train.max_steps=1", f"results_dir={results}", *overrides))
    assert record["status"] == "ok", record["reason"]
    return record["memory"]["step"]


def test_fp32_lenet_holds_what_a_hand_count_says(make_cfg, tmp_path):
    counted = step_memory(make_cfg, tmp_path, "format=fp32")
    activations = B * (4 * sum(MATMUL_INPUTS + RELU_OUTPUTS) + 8 * sum(POOL_INDICES) + LOSS) + LOSS_SCALAR
    assert counted == {"parameters": 4 * LENET_PARAMS, "gradients": 4 * LENET_PARAMS,
                       "optimizer_state": 4 * LENET_PARAMS,  # SGD's momentum buffers
                       "weight_copies": 0, "activations": activations,
                       "total": 12 * LENET_PARAMS + activations}


@pytest.mark.parametrize("mode", ["mixed", "true"])
def test_emulated_bf16_is_counted_as_native_bf16_holds_it(make_cfg, tmp_path, mode):
    emulated = step_memory(make_cfg, tmp_path, "format=bf16", f"format.mode={mode}", "format.backend=emulated")
    native = step_memory(make_cfg, tmp_path, "format=bf16", f"format.mode={mode}", "format.backend=native")
    assert emulated == native
    stored = 2 if mode == "true" else 4
    activations = B * (2 * sum(MATMUL_INPUTS + RELU_OUTPUTS) + 8 * sum(POOL_INDICES) + LOSS) + LOSS_SCALAR
    assert emulated == {"parameters": stored * LENET_PARAMS, "gradients": stored * LENET_PARAMS,
                        "optimizer_state": stored * LENET_PARAMS,
                        "weight_copies": 0 if mode == "true" else 2 * WEIGHTS,  # autocast's bf16 weight cache
                        "activations": activations, "total": 3 * stored * LENET_PARAMS + activations
                        + (0 if mode == "true" else 2 * WEIGHTS)}


def test_tf32_holds_what_fp32_holds(make_cfg, tmp_path):
    """TF32 tensor cores read FP32 storage: no copies, the same bytes as 32-true."""
    assert step_memory(make_cfg, tmp_path, "format=tf32") == step_memory(make_cfg, tmp_path, "format=fp32")


def test_emulated_fp8_counts_what_enters_a_matmul_at_one_byte(make_cfg, tmp_path):
    """FP8 GEMMs read E4M3 inputs and write FP32: the matmul inputs and weight copies are 1 byte, the ReLU outputs
    between them stay FP32 (4 bytes), and FP32 master weights, gradients and optimiser state are 4 bytes."""
    counted = step_memory(make_cfg, tmp_path, "format=fp8", "format.elsewhere=fp32")
    fc_relus = [120, 84]  # fc2's and fc3's inputs are fc1's and fc2's ReLU outputs, saved by the ReLU in FP32
    activations = B * (1 * sum(MATMUL_INPUTS) + 4 * sum(RELU_OUTPUTS + fc_relus) + 8 * sum(POOL_INDICES) + LOSS) \
        + LOSS_SCALAR
    assert counted["weight_copies"] == WEIGHTS
    assert counted["activations"] == activations
    assert counted["parameters"] == counted["gradients"] == counted["optimizer_state"] == 4 * LENET_PARAMS


def test_fp8_with_bf16_elsewhere_counts_what_runs_outside_the_gemms_at_two_bytes(make_cfg, tmp_path):
    """format.elsewhere=bf16 (fp8's default): the GEMMs still save their E4M3 operands (1 byte), and the ReLU
    outputs between them are BF16, as the GEMMs hand them on under autocast; the loss stays FP32 (autocast's)."""
    counted = step_memory(make_cfg, tmp_path, "format=fp8", "format.elsewhere=bf16")
    fc_relus = [120, 84]
    activations = B * (1 * sum(MATMUL_INPUTS) + 2 * sum(RELU_OUTPUTS + fc_relus) + 8 * sum(POOL_INDICES) + LOSS) \
        + LOSS_SCALAR
    assert counted["weight_copies"] == WEIGHTS
    assert counted["activations"] == activations
    assert counted["parameters"] == counted["gradients"] == counted["optimizer_state"] == 4 * LENET_PARAMS


def test_flops_per_step_are_lenets_by_hand(make_cfg, tmp_path):
    """Forward 2·MACs per layer; backward: weight gradients for every layer, input gradients for all but conv1."""
    forward = [2 * B * 6 * 28 * 28 * 25, 2 * B * 16 * 10 * 10 * 150, 2 * B * 400 * 120, 2 * B * 120 * 84,
               2 * B * 84 * 10]
    record = run_cell(make_cfg("model=lenet", "train.max_steps=2", "format=fp32", f"results_dir={tmp_path}/a"))
    assert record["timing"]["flops_per_step"] == 3 * sum(forward) - forward[0]
    assert record["timing"]["tflop_per_s"] > 0  # native fp32
    emulated = run_cell(make_cfg("model=lenet", "train.max_steps=2", "format=fp8", f"results_dir={tmp_path}/b"))
    assert emulated["timing"]["flops_per_step"] == 3 * sum(forward) - forward[0]
    assert emulated["timing"]["tflop_per_s"] is None  # an emulated step's time says nothing of FP8's throughput


def test_the_raschka_comparison_counts_a_distilbert_step_per_setting():
    """The command behind results/tables/raschka_memory, on a tiny DistilBERT: true modes hold parameters and
    gradients at half of 32-true's bytes, mixed modes at 32-true's, and the table sits beside Raschka's GB."""
    from transformers import DistilBertConfig

    from bench.tools.raschka_memory import SETTINGS, comparison, step_breakdown

    config = DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                              max_position_embeddings=64, num_labels=2)
    counted = {setting: step_breakdown(setting, config, batch=2, length=16) for setting in SETTINGS}
    fp32 = counted["32-true"]
    assert 2 * counted["bf16-true"]["parameters"] == fp32["parameters"] == counted["bf16-mixed"]["parameters"]
    assert 2 * counted["bf16-true"]["gradients"] == fp32["gradients"] == counted["16-mixed"]["gradients"]
    assert counted["16-mixed"]["backend"] == "emulated" and fp32["weight_copies"] == 0
    assert counted["16-mixed"]["weight_copies"] > 0  # the 16-bit weight copies a mixed step saves
    table = comparison(counted)
    assert list(table["setting"]) == list(SETTINGS)
    assert list(table["published memory (GB)"]) == ["5.37", "4.31", "4.46", "2.87"]
    assert table.loc[0, "modelled vs 32-true"] == "1.00"


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_bench_predict_and_the_record_count_a_batchnorm_models_step_alike(make_cfg, tmp_path, monkeypatch, fmt):
    """One memory answer: a tiny ResNet with BatchNorm, in-place ReLUs and a max-pool (tests/plugin), its step as
    bench.predict models it from the trace and as the native run counts it (bench/numerics/memory.py), within 0.1%.
    Neither counts BatchNorm's running statistics (buffers, not parameters). Native on every CPU: where the CPU lacks
    BF16 units, the auto backend emulates bf16, whose BatchNorm runs in FP32 (docs/memory.md says by how much)."""
    from pathlib import Path

    from bench.reporting.predict_cells import rows
    from bench.speed.profiles import gpu

    plugin = Path(__file__).parent / "plugin"
    monkeypatch.syspath_prepend(str(plugin))
    search = f"hydra.searchpath=[file://{plugin / 'conf'}]"
    record = run_cell(make_cfg(search, "model=resnet", f"format={fmt}", "format.backend=native",
                                "train.max_steps=2", "train.log_every=1"))
    assert record["status"] == "ok", record["reason"]
    measured = record["memory"]["step"]["total"] / 2**20
    predicted = float(rows([search, "model=resnet", f"format={fmt}"], [gpu("H100")])[0]["memory (MiB)"])
    assert predicted == pytest.approx(measured, rel=1e-3)


def _mlm(make_cfg, text_file, *overrides):
    return make_cfg("model=bert_mlm_tiny", "model.data.source=local", f"model.data.path={text_file}",
                    "model.data.sha256=null", "train.max_steps=1", *overrides)


MLM_HIDDEN = 32 * 64 * 64  # BERT-MLM tiny's batch x length x hidden size


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_bench_predict_counts_a_masked_lms_activations_as_its_record_does(make_cfg, text_file, fmt, predicted_memory):
    """BERT-MLM tiny without dropout, one native step: bench.predict's saved activations against the record's.
    FP32: equal (the trace gave windows without padding an attention mask, a float one per layer: 1 MiB over).
    bf16-mixed: the prediction follows CUDA autocast's types op by op (LayerNorm, log-softmax and the residual stream
    beside the FP32 embeddings stay FP32; each GEMM saves its own BF16 cast of an FP32 input), where it held every
    activation in BF16 (20% under). They part by one tensor: the MLM head's LayerNorm input, which CUDA autocast casts
    to FP32 (and saves) and CPU autocast, the record's, leaves in BF16: two bytes more per element."""
    cfg = _mlm(make_cfg, text_file, f"format={fmt}", "format.backend=native", "model.arch.dropout=0")
    record = run_cell(cfg)
    assert record["status"] == "ok", record["reason"]
    recorded, predicted = record["memory"]["step"]["activations"], predicted_memory(cfg)["activations"]
    cuda_over_cpu_autocast = 2 * MLM_HIDDEN if fmt == "bf16" else 0
    assert predicted == pytest.approx(recorded + cuda_over_cpu_autocast, rel=1e-3)


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_bench_predict_holds_a_dropout_mask_in_a_byte(make_cfg, text_file, fmt, predicted_memory):
    """A GPU's dropout (aten.native_dropout) keeps its mask as booleans, where the traced step (a CPU's dropout)
    draws it in the model's type: BERT-MLM tiny's five dropouts (the embeddings', and each layer's two; attention's
    is the fused kernel's) add one byte per element to the step's activations, in FP32 and in bf16-mixed alike."""
    without, with_dropout = (predicted_memory(_mlm(make_cfg, text_file, f"format={fmt}", f"model.arch.dropout={p}"))
                             for p in (0, 0.1))
    assert with_dropout["activations"] - without["activations"] == 5 * MLM_HIDDEN
