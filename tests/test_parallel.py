"""One cell on several processes (bench/running/parallel.py): the parallel keys and their refusals, a distributed
cell's identity and place, the batch shares, and LeNet cells of two ranks under DDP and FSDP2 against the
one-device cell, against each other, and against torch's own compression hook."""

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bench.errors import ConfigError
from bench.numerics.readings import Readings
from bench.running import parallel
from bench.running.config import check
from bench.running.identity import run_id


@pytest.mark.parametrize("overrides, says", [
    (["parallel.name=zero"], "parallel='zero' is not valid; valid: none, ddp, fsdp2"),
    (["parallel.world_size=2"], "parallel=none trains on one device"),
    (["parallel=ddp", "parallel.world_size=0"], "parallel.world_size=0: a job has one rank or more"),
    # a newcomer's trial (2026-11-30): an empty share trained to a NaN loss, recorded as the format's divergence;
    # shares 11, 11 and 10 averaged as equals gave another loss than one device's
    (["parallel=ddp", "parallel.world_size=3"], "valid world sizes for it: 1, 2, 4, 8, 16, 32"),
    (["parallel=fsdp2", "parallel.world_size=64"], "parallel.world_size=64 does not split model.batch_size=32"),
    (["parallel=ddp", "parallel.reduce_dtype=bf16"], "valid with parallel=fsdp2 (under parallel=ddp: fp32)"),
    (["parallel=fsdp2", "parallel.param_dtype=fp8"], "valid: fp32, fp16, bf16"),
    (["parallel=fsdp2", "parallel.gradient_compression=bf16"], "DDP's communication hook: valid with parallel=ddp"),
    (["parallel=ddp", "parallel.gradient_compression=int8"], "valid: none, fp16, bf16"),
    (["parallel=ddp", "parallel.fp8_all_gather=true"], "valid with parallel=fsdp2 (under parallel=ddp: false)"),
    (["parallel=fsdp2", "parallel.fp8_all_gather=true", "format=fp8", "scaling=rowwise"],
     "valid with format=fp8 scaling=per_tensor (this cell: format=fp8 scaling=rowwise)"),
    (["parallel=fsdp2", "device=xla"], "parallel=fsdp2 does not run with device=xla yet"),
    (["parallel=ddp", "train.compile=true"], "compiles the model's blocks one by one, and this model declares none"),
])
def test_parallel_keys_and_what_they_do_not_combine_with_are_refused_naming_the_valid_ones(make_cfg, overrides, says):
    with pytest.raises(ConfigError) as refused:
        check(make_cfg(*overrides))
    assert says in str(refused.value)


def test_a_one_device_cell_keeps_its_identity_and_a_distributed_one_has_its_own_place(make_cfg):
    """parallel=none (every key at its default) is left out of a run's identity, so runs made before the section
    existed resume and pair; parallel=ddp is another run, in another directory."""
    one = make_cfg("model=lenet")
    config = OmegaConf.to_container(one, resolve=True)
    before = {k: v for k, v in config.items() if k != "parallel"}  # a record made before the section existed
    assert run_id(config) == run_id(before)
    assert "parallel" not in one.cell
    two = make_cfg("model=lenet", "parallel=ddp")
    assert run_id(OmegaConf.to_container(two, resolve=True)) != run_id(config)
    assert two.cell.endswith(",parallel.name=ddp,parallel.world_size=2")


def test_a_distributed_cell_is_a_column_of_its_one_device_cells_design_and_its_options_name_what_it_sent(make_cfg):
    """Like the optimiser's state format, the parallel keys are numeric choices: the same design as the one-device
    cell (so a table pairs them), and the cell's options say what its communication was."""
    from bench.reporting.aggregate import _flatten, format_options, numeric_choices
    from bench.running.identity import comparison_ids, semantic_config

    def ids_and_options(*overrides):
        semantic = semantic_config(OmegaConf.to_container(make_cfg("model=lenet", *overrides), resolve=True))
        return comparison_ids(semantic)["design_id"], format_options({}, numeric_choices(_flatten(semantic)))

    one, ddp = ids_and_options(), ids_and_options("parallel=ddp", "parallel.gradient_compression=bf16")
    assert ddp[0] == one[0] and one[1] == ""
    assert ddp[1] == "parallel=ddp, world_size=2, gradient_compression=bf16"


def test_each_rank_trains_on_its_contiguous_share_of_every_batch():
    x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    shares = [parallel.shard((x, {"labels": y}), parallel.Ranks(rank, 2)) for rank in range(2)]
    assert torch.equal(torch.cat([s[0] for s in shares]), x)
    assert [s[1]["labels"].tolist() for s in shares] == [[0, 1, 2], [3, 4]]


def test_a_read_combines_the_window_once_before_its_transfer():
    readings = Readings(4)
    for value in (1.0, 2.0):
        readings.push(torch.tensor(value))
    assert readings.read(lambda rows: rows * 10) == [[10.0], [20.0]]
    assert readings.read() == []


# Each cell is a job of two ranks forked from the launcher's fork server (about 2 s here): fast enough for make test.
SETTINGS = {"one": [], "ddp": ["parallel=ddp"], "fsdp2": ["parallel=fsdp2"],
            "ddp_bf16": ["parallel=ddp", "parallel.gradient_compression=bf16"],
            "fsdp2_reduce_bf16": ["parallel=fsdp2", "parallel.reduce_dtype=bf16"],
            "fsdp2_param_bf16": ["parallel=fsdp2", "parallel.param_dtype=bf16"],
            **{f"{wrapper}_unit": [f"parallel={wrapper}", "scaling=unit", "model.optimizer.name=adamw"]
               for wrapper in ("none", "ddp", "fsdp2")},
            **{f"{wrapper}_{fmt}": [f"parallel={wrapper}", f"format={fmt}", f"scaling={scaling}"]
               for wrapper in ("ddp", "fsdp2") for fmt, scaling in (("fp8", "per_tensor"), ("mxfp8", "none"))}}
LENET_PARAMETERS = 61_706


@pytest.fixture(scope="module")
def lenet_cells(tmp_path_factory):
    from hydra import compose, initialize_config_dir

    from bench.running.run import run_cell

    root = tmp_path_factory.mktemp("parallel")
    records = {}
    for name, overrides in SETTINGS.items():
        with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"results_dir={root}", "model=lenet", "train.max_steps=6",
                                               "train.log_every=2", *overrides])
        records[name] = run_cell(cfg)
        assert records[name]["status"] == "ok", records[name]["reason"]
    return root, records


def test_two_ranks_in_fp32_train_the_one_device_cell_up_to_the_order_of_their_sums(lenet_cells):
    """Each rank takes half of every batch and DDP averages the two halves' gradients: the whole batch's mean,
    summed in another order. FSDP2 in FP32 reduces the same values as DDP, bit for bit."""
    _, records = lenet_cells
    loss = {name: r["metrics"]["final_train_loss"] for name, r in records.items()}
    assert loss["ddp"] != loss["one"] and math.isclose(loss["ddp"], loss["one"], rel_tol=1e-6)
    assert loss["fsdp2"] == loss["ddp"]
    # each rank held half the batch's activations
    assert records["ddp"]["memory"]["step"]["activations"] < 0.6 * records["one"]["memory"]["step"]["activations"]


def test_gradients_reduced_in_bf16_are_the_same_through_ddps_hook_and_fsdp2_and_not_fp32s(lenet_cells):
    _, records = lenet_cells
    loss = {name: r["metrics"]["final_train_loss"] for name, r in records.items()}
    assert loss["ddp_bf16"] == loss["fsdp2_reduce_bf16"] != loss["ddp"]
    assert loss["fsdp2_param_bf16"] not in (loss["fsdp2"], loss["fsdp2_reduce_bf16"])


def test_a_unit_scaled_cell_trains_alike_under_ddp_and_fsdp2_whose_new_parameters_keep_their_lr_factors(lenet_cells):
    """Unit scaling's relative learning rates are keyed by parameter; FSDP2 replaces every parameter with a sharded
    one, so the factors must follow them (without, FSDP2 trains at the plain lr and ends elsewhere: 2.373 against
    2.055). Equal within 1e-6, not bit for bit: on a 2-core AMD EPYC with AVX2 (2026-11-28) the two ended one FP32
    unit apart (2.0550327 and 2.0550325, with SGD too), where the AVX-512 machines gave the same bits."""
    _, records = lenet_cells
    loss = {name: r["metrics"]["final_train_loss"] for name, r in records.items()}
    assert math.isclose(loss["fsdp2_unit"], loss["ddp_unit"], rel_tol=1e-6)
    assert math.isclose(loss["ddp_unit"], loss["none_unit"], rel_tol=1e-5) and loss["none_unit"] != loss["one"]


def test_emulated_formats_train_alike_under_ddp_and_fsdp2(lenet_cells):
    """FP8 with per-tensor scales (each rank scaling its share's activations and gradients by their own amax) and
    MXFP8, emulated: the ranks round the same tensors under either wrapper, and FSDP2 reduces as DDP does."""
    _, records = lenet_cells
    for fmt in ("fp8", "mxfp8"):
        ddp, fsdp2 = records[f"ddp_{fmt}"], records[f"fsdp2_{fmt}"]
        assert ddp["env"]["precision"]["backend"] == "emulated" and ddp["numerics"]["quantisation"]
        assert fsdp2["metrics"]["final_train_loss"] == ddp["metrics"]["final_train_loss"] != \
            records["ddp"]["metrics"]["final_train_loss"]


def test_a_distributed_record_counts_each_collectives_bytes_and_each_ranks_peak(lenet_cells):
    """LeNet's 61,706 FP32 parameters: DDP all-reduces every gradient (4 bytes each, 2 in BF16); FSDP2 all-gathers
    each rank's half of the parameters in param_dtype and reduce-scatters every gradient in reduce_dtype. The
    profiled step's collectives, as gloo ran them. Rank 0 alone writes: one record, in the cell's directory."""
    root, records = lenet_cells
    sent = {name: r["parallel"]["collective_bytes_first_step"] for name, r in records.items() if "parallel" in r}
    n = LENET_PARAMETERS
    assert sent["ddp"] == {"all_reduce": 4 * n} and sent["ddp_bf16"] == {"all_reduce": 2 * n}
    assert sent["fsdp2"] == {"all_gather": 4 * n // 2, "reduce_scatter": 4 * n}
    assert sent["fsdp2_reduce_bf16"] == {"all_gather": 4 * n // 2, "reduce_scatter": 2 * n}
    assert sent["fsdp2_param_bf16"] == {"all_gather": 2 * n // 2, "reduce_scatter": 4 * n}
    assert sent["fsdp2_unit"] == sent["fsdp2"] and sent["ddp_unit"] == sent["ddp"]
    timed = {name: r["parallel"]["collective_time"] for name, r in records.items() if "parallel" in r}
    assert all(t["step"] == 2 and 0 < t["collective_s"] < t["step_s"] for t in timed.values()), timed
    assert "gloo:all_reduce" in timed["ddp"]["by_event_s"] and "gloo:all_gather" in timed["fsdp2"]["by_event_s"]
    assert "gloo:all_gather" not in timed["ddp"]["by_event_s"]
    for name in sent:
        section = records[name]["parallel"]
        assert len(section["peak_bytes_per_rank"]) == 2 and section["peak_bytes_max"] == max(
            section["peak_bytes_per_rank"])
    assert len(list(root.rglob("result.json"))) == len(SETTINGS)
    assert len(list(root.rglob("metrics.jsonl"))) == len(SETTINGS)


def _hooked_gradients(rank: int, store_path: str, out: str) -> None:
    """Rank `rank` of two: one step's gradients of a Linear under torch's fp16_compress_hook, ours in FP16, ours in
    FP32."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    found = []
    for hook in (fp16_compress_hook, parallel.reduce_in(torch.float16), parallel.reduce_in(torch.float32)):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(64, 32))
        model.register_comm_hook(None, hook)
        torch.manual_seed(1 + rank)
        model(torch.randn(8, 64) * 100).square().sum().backward()
        found.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.save(found, f"{out}.{rank}")
    del model  # DDP's reducer holds the process group, and its hook's futures
    _leave(dist)


def _leave(dist) -> None:
    """A rank's last step, its caller having let go of what holds the process group (DDP's reducer and its hooks'
    futures, FSDP2's modules): those freed (cycles too), the ranks met, then the group destroyed, as
    `parallel._train_rank` leaves it once its cell's objects are gone. A group destroyed under a live DDP model
    aborted a rank once at exit ("terminate called without an active exception", 2026-12-01; not seen again in 12
    runs)."""
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def test_our_fp16_reduction_hook_is_torchs_fp16_compress_hook_bit_for_bit(tmp_path):
    """The reference: torch's own fp16_compress_hook (our hook differs only by being usable on CPU for BF16)."""
    torch.multiprocessing.spawn(_hooked_gradients, args=(str(tmp_path / "store"), str(tmp_path / "g")), nprocs=2)
    theirs, ours, full = torch.load(tmp_path / "g.0")
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    assert not torch.equal(full, ours)  # FP16's rounding shows in the sums


def _sharded_steps(rank: int, store_path: str, out: str) -> None:
    """Rank `rank` of two, a Linear under FSDP2 (each rank holds half its weight's rows): (1) the loss scaler's step
    where only rank 1's shard of the gradient holds an inf; (2) a bf16_stochastic master-weight step from seed 0;
    (3) parallel.wrap of a Linear whose weight carries an attribute."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from bench.numerics.master_weights import MasterWeights
    from bench.numerics.scaling import LossScaler

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(16, 8, bias=False))
    weight = model.weight
    local = torch.ones_like(weight.to_local())
    if rank == 1:
        local[0, 0] = float("inf")
    weight.grad = DTensor.from_local(local, weight.device_mesh, weight.placements)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = weight.to_local().clone()
    scaler = LossScaler("dynamic", init_scale=1024.0)
    scaler.step(optimizer, [weight])
    scaler.sync()
    skipped = (scaler.skipped_steps, torch.equal(weight.to_local(), before))
    torch.manual_seed(0)
    master = MasterWeights("bf16_stochastic", model, optimizer)
    with torch.no_grad():
        weight.to_local().copy_(torch.linspace(1, 2, weight.to_local().numel()).view_as(before) / 3 + rank)
    master.after_step()
    from omegaconf import OmegaConf

    plain = torch.nn.Linear(16, 8, bias=False)
    original = plain.weight
    original.mup_type = "weight"  # a u-μP attribute
    cfg = OmegaConf.create({"parallel": {"name": "fsdp2", "param_dtype": "fp32", "reduce_dtype": "fp32"},
                            "model": {"task": {"blocks": None}}})
    wrapped = parallel.wrap(plain, cfg, torch.device("cpu"))
    (old, new), = wrapped.replaced.items()
    kept = old is original and isinstance(new, DTensor) and new is wrapped.model.weight and new.mup_type == "weight"
    torch.save({"skipped": skipped, "rounded": weight.full_tensor(), "kept": kept}, f"{out}.{rank}")
    del model, weight, optimizer, master, plain, original, wrapped, old, new
    _leave(dist)


def test_under_fsdp2_the_loss_scaler_skips_on_every_rank_and_stochastic_master_weights_round_the_whole(tmp_path):
    """FSDP2 shards each gradient: an inf in one rank's shard must skip the step on every rank (the found-inf flag
    all-reduced, as torch's ShardedGradScaler does), or the ranks' shards of one weight drift apart. A sharded weight
    rounded stochastically to BF16 draws the whole weight's uniforms on every rank: the result is the unsharded
    weight's rounding from the same seed, bit for bit (not two shards rounded with the same draws)."""
    from bench.numerics.formats import quantise_stochastic

    torch.multiprocessing.spawn(_sharded_steps, args=(str(tmp_path / "store"), str(tmp_path / "r")), nprocs=2)
    ranks = [torch.load(tmp_path / f"r.{rank}") for rank in range(2)]
    assert [r["skipped"] for r in ranks] == [(1, True), (1, True)]
    whole = torch.cat([torch.linspace(1, 2, 64).view(4, 16) / 3 + rank for rank in range(2)])
    torch.manual_seed(0)
    assert torch.equal(ranks[0]["rounded"], quantise_stochastic(whole, "bf16"))
    assert torch.equal(ranks[0]["rounded"], ranks[1]["rounded"])
    assert ranks[0]["kept"] and ranks[1]["kept"]  # parallel.wrap: FSDP2's new parameters keep u-μP's attributes


@pytest.mark.slow
def test_a_two_rank_bf16_reduction_rounds_once_and_the_error_grows_with_the_ranks(tmp_path):
    """Two summands: gloo's BF16 all-reduce is one rounding of their exact sum (the reference: each share cast to
    BF16, added in FP32, exact for two BF16 values within 2^16 of each other, and rounded once). And the error of the
    average grows from 2 ranks to 4, the summation's part of it beside a cast whose error does not."""
    from bench.tools import reduction_error as tool

    torch.multiprocessing.spawn(tool._rank, args=(2, str(tmp_path / "store"), 4096, 0, str(tmp_path / "out.pt")),
                                nprocs=2)
    reduced = torch.load(tmp_path / "out.pt")["bf16"]
    shares = [(tool._values(rank, 4096, 0) / 2).to(torch.bfloat16).float() for rank in range(2)]
    assert torch.equal(reduced, (shares[0] + shares[1]).to(torch.bfloat16).float())
    two, four = (next(r for r in tool.measure(world, 4096) if r["type"] == "bf16") for world in (2, 4))
    assert four["relative_rms_error"] > two["relative_rms_error"] > two["of_which_inputs_cast"]
    assert four["of_which_inputs_cast"] == pytest.approx(two["of_which_inputs_cast"], rel=0.1)


# On a CUDA GPU (`pytest -m cuda` where one is; CI has none): the NCCL path, one rank (a lent machine has one GPU).
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_one_nccl_rank_trains_the_one_device_cell_and_counts_its_collectives(tmp_path):
    """With one rank DDP's average and FSDP2's shards are the whole: the loss is the one-device cell's (up to cuDNN's
    choice of algorithm), a BF16 reduction still rounds the gradients, and the record counts the bytes handed to NCCL
    and the rank's CUDA peak."""
    from hydra import compose, initialize_config_dir

    from bench.running.run import run_cell

    records = {}
    for name, overrides in {"one": [], "ddp": ["parallel=ddp"], "fsdp2": ["parallel=fsdp2"],
                            "ddp_bf16": ["parallel=ddp", "parallel.gradient_compression=bf16"]}.items():
        with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"results_dir={tmp_path}", "model=lenet", "device=cuda",
                                               "train.max_steps=6", "train.log_every=2", *overrides,
                                               *(["parallel.world_size=1"] if overrides else [])])
        records[name] = run_cell(cfg)
        assert records[name]["status"] == "ok", records[name]["reason"]
    loss = {name: r["metrics"]["final_train_loss"] for name, r in records.items()}
    assert math.isclose(loss["ddp"], loss["one"], rel_tol=1e-5) and math.isclose(loss["fsdp2"], loss["ddp"],
                                                                                rel_tol=1e-5)
    assert loss["ddp_bf16"] != loss["ddp"]
    n = LENET_PARAMETERS
    assert records["ddp"]["parallel"]["collective_bytes_first_step"] == {"all_reduce": 4 * n}
    assert records["ddp_bf16"]["parallel"]["collective_bytes_first_step"] == {"all_reduce": 2 * n}
    assert records["fsdp2"]["parallel"]["collective_bytes_first_step"] == {}  # FSDP2 calls none on one rank
    assert records["ddp"]["env"]["device_type"] == "cuda" and records["ddp"]["parallel"]["peak_bytes_max"] > 0



# A plug-in (the `plugins` key: every rank imports it before it trains) that kills its own rank 1 once the ranks
# have saved a checkpoint, after writing its pid down (the first job's alone): a rank lost mid-training, as an OOM
# killer or a dead node loses one.
KILLER = """
import os, signal, threading, time
from pathlib import Path

out = Path(os.environ["KILLED_RANK_PIDS"])
if os.environ.get("RANK") == "1" and not out.exists():  # the first job's rank 1 only
    out.write_text(str(os.getpid()))

    def _kill():
        while not list(out.parent.rglob("checkpoint.dcp/extra.pt")):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_kill, daemon=True).start()
"""


def test_a_killed_rank_fails_its_cell_with_a_summary_stops_the_other_ranks_and_the_sweep_goes_on(tmp_path):
    """Rank 1 of a two-rank DDP cell is SIGKILLed mid-training: the cell's record says failed, naming the rank and
    the signal; no rank of its job is left running; the sweep's next cell (no killer in it) trains and is
    recorded; run again with retry_failed=true, the cell resumes from its last checkpoint."""
    import subprocess
    import sys

    (tmp_path / "kill_rank_one.py").write_text(KILLER)
    pids = tmp_path / "results" / "killed.pid"
    pids.parent.mkdir()
    cmd = [sys.executable, "-m", "bench.run", "-m", "model=lenet", "parallel=ddp", "train.max_steps=400,6",
           "train.checkpoint_every=2", "plugins=[kill_rank_one]", f"results_dir={pids.parent}"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "KILLED_RANK_PIDS": str(pids),
                        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    sweep = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                           timeout=300)
    found = [json.loads(p.read_text()) for p in pids.parent.rglob("result.json")]
    by_steps = {r["config"]["train"]["max_steps"]: r for r in found}
    assert sorted(by_steps) == [6, 400], sweep.stdout[-3000:] + sweep.stderr[-3000:]
    assert "USDT" not in sweep.stdout + sweep.stderr  # kineto's trace points, from the ranks' profiled step
    assert by_steps[400]["status"] == "failed" and by_steps[6]["status"] == "ok"
    assert by_steps[400]["reason"].startswith(f"JobFailed: rank 1 of 2 (pid {pids.read_text()}) was killed by SIGKILL;")
    assert not Path(f"/proc/{pids.read_text()}").exists()
    again = subprocess.run([*cmd, "retry_failed=true"], cwd=Path(__file__).resolve().parents[1], env=env,
                           capture_output=True, text=True, timeout=300)
    retried = next(json.loads(p.read_text()) for p in pids.parent.rglob("result.json")
                   if json.loads(p.read_text())["config"]["train"]["max_steps"] == 400)
    assert retried["status"] == "ok" and retried["resumed_from"]["step"] > 0, again.stdout[-3000:]


def test_a_rank_that_crashed_as_its_peer_was_killed_is_not_named_the_cause():
    """The launcher found rank 1 killed (SIGKILL) and rank 0 crashed (SIGSEGV, in gloo's closed connection) in one
    check: torch stamps both with that second and its own choice names rank 0; ours names rank 1, and says rank 0's
    end too. Of two ends of their own in one second, the lower rank; an error a second earlier comes first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failed(*ends):
        failures = {}
        for rank, (exitcode, second) in enumerate(ends):
            failures[rank] = ProcessFailure(local_rank=rank, pid=4240 + rank, exitcode=exitcode, error_file="")
            failures[rank].timestamp = second
        return ChildFailedError("rank", failures)

    crashed_as_killed = failed((-signal.SIGSEGV, 100), (-signal.SIGKILL, 100))
    assert crashed_as_killed.get_first_failure()[0] == 0  # torch's choice, which this guards against
    assert parallel.first_failure(crashed_as_killed)[0] == 1
    assert parallel.failure_summary(crashed_as_killed, 2) == (
        "rank 1 of 2 (pid 4241) was killed by SIGKILL; rank 0 (pid 4240) had ended too: it was killed by SIGSEGV")
    assert parallel.failure_summary(crashed_as_killed, 4).endswith("; the launcher stopped the other ranks")
    lost_peer_as_crashed = failed((1, 100), (-signal.SIGSEGV, 100))
    lost_peer_as_crashed.failures[0].message = "RuntimeError: [gloo] Read error: Connection reset by peer"
    assert parallel.first_failure(lost_peer_as_crashed)[0] == 1
    assert parallel.first_failure(failed((-signal.SIGKILL, 100), (-signal.SIGTERM, 100)))[0] == 0
    assert parallel.first_failure(failed((-signal.SIGSEGV, 99), (-signal.SIGKILL, 100)))[0] == 0


# A plug-in whose rank 1 stops answering at its third backward pass (a rank stuck, not dead): rank 0 waits in the
# gradients' all-reduce until the collective timeout.
STALLER = """
import os, signal, time
import torch

if os.environ.get("RANK") == "1":
    _backward, _calls = torch.Tensor.backward, []

    def _stalls(self, *args, **kwargs):
        _calls.append(1)
        if len(_calls) == 3:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # stuck where no Python handler runs: the launcher's
            time.sleep(3600)                                # SIGTERM ends it at once, not its SIGKILL 30 s later
        return _backward(self, *args, **kwargs)
    torch.Tensor.backward = _stalls
"""


@pytest.mark.slow
def test_a_rank_that_stops_answering_fails_its_cell_as_a_collective_timeout_not_a_hang(tmp_path):
    """With the collective timeout at 5 s, rank 0's all-reduce gives up on the silent rank 1: the cell's record
    (rank 0's) says the collective timed out, and the launcher stops the stuck rank instead of waiting on it."""
    import subprocess
    import sys

    (tmp_path / "stall_rank_one.py").write_text(STALLER)
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench.run", "model=lenet", "parallel=ddp", "train.max_steps=50",
           "plugins=[stall_rank_one]", f"results_dir={results}"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", parallel.TIMEOUT_VARIABLE: "5",
                        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                         timeout=240)
    (record,) = [json.loads(p.read_text()) for p in results.rglob("result.json")]
    assert record["status"] == "failed", run.stdout[-3000:] + run.stderr[-3000:]
    assert "Timed out" in record["reason"] and "5000ms" in record["reason"], record["reason"]
    assert "its job failed: rank 0 of 2" in run.stdout + run.stderr


def _lenet_job(results: Path, *overrides: str):
    """`python -m bench.run` of a two-rank LeNet FSDP2 cell of 150 steps, checkpointing every 5, keeping its last."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "bench.run", "model=lenet", "parallel=fsdp2", "train.max_steps=150",
           "train.checkpoint_every=5", "train.keep_checkpoint=true", "train.log_every=10", f"results_dir={results}",
           *overrides]
    return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})


def _stopped_at_a_checkpoint(results: Path, *overrides: str) -> int:
    """Start the cell, SIGTERM its launching process once the ranks have saved a checkpoint (as SLURM does before a
    pre-emption), and wait for it: no record; the step the ranks saved at."""
    import signal
    import time

    job = _lenet_job(results, *overrides)
    deadline = time.monotonic() + 120
    while not list(results.rglob("checkpoint.dcp/extra.pt")):
        assert time.monotonic() < deadline and job.poll() is None, "no checkpoint was written"
        time.sleep(0.1)
    os.kill(job.pid, signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert job.returncode != 0 and not list(results.rglob("result.json")), output[-3000:]
    (folder,) = results.rglob("checkpoint.dcp")
    return torch.load(folder / "extra.pt", weights_only=False)["loop"]["steps"]


def _finished(results: Path, *overrides: str) -> tuple[dict, dict]:
    """Run the cell to its end: (its record, its final weights as its last checkpoint holds them)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    job = _lenet_job(results, *overrides)
    output, _ = job.communicate(timeout=300)
    (record,) = [json.loads(p.read_text()) for p in results.rglob("result.json")]
    assert record["status"] == "ok", output[-3000:]
    (folder,) = [p for p in results.rglob("checkpoint.dcp") if (p.parent / "result.json").exists()]
    dcp_to_torch_save(folder, results / "final.pt")
    return record, torch.load(results / "final.pt", weights_only=False)["model"]


def test_a_pre_empted_distributed_cell_resumes_bit_for_bit_and_at_another_world_size(tmp_path):
    """Two-rank FSDP2 LeNet through torch.distributed.checkpoint: stopped by SIGTERM after a checkpoint and run
    again, it ends with the uninterrupted cell's weights, bit for bit. A copy of the same stop, run again on one rank,
    resumes from the two-rank checkpoint (DCP reshards the shards into one) and ends within the reduction order's
    reach of the two-rank weights."""
    import shutil

    whole, weights = _finished(tmp_path / "whole")
    stopped = _stopped_at_a_checkpoint(tmp_path / "stopped")
    shutil.copytree(tmp_path / "stopped", tmp_path / "resharded")  # the same stop, resumed on one rank below
    resumed, resumed_weights = _finished(tmp_path / "stopped")
    assert 0 < stopped < 150 and resumed["resumed_from"] == {"checkpoint": "checkpoint.dcp", "step": stopped,
                                                             "world_size": 2}
    assert resumed["metrics"]["final_train_loss"] == whole["metrics"]["final_train_loss"]
    assert weights.keys() == resumed_weights.keys()
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)

    one_rank, one_rank_weights = _finished(tmp_path / "resharded", "parallel.world_size=1")
    assert one_rank["resumed_from"]["world_size"] == 2 and one_rank["resumed_from"]["step"] == stopped
    assert one_rank["resumed_from"]["checkpoint"].endswith(",parallel.world_size=2,train.max_steps=150/checkpoint.dcp")
    assert math.isclose(one_rank["metrics"]["final_train_loss"], whole["metrics"]["final_train_loss"], rel_tol=1e-3)
    assert all(torch.allclose(weights[k], one_rank_weights[k], rtol=1e-3, atol=1e-5) for k in weights)


def test_the_per_rank_memory_model_meets_the_ranks_measured_in_the_committed_experiment():
    """bench.predict's memory per rank (bench.speed.model.rank_memory, from `step_memory` of rank 0's share of the
    batch) against rank 0's step as its record counted it, in experiment=distributed_precision (the char-LM, AdamW, two
    ranks): the one-device step and DDP's to 0.01% (DDP's gradient buckets are modelled, not counted by the record);
    FSDP2's, whose all-gathered parameters the record counts among the activations, within 7% of its total."""
    import gzip

    from bench.reporting.predict_cells import _rank_share, _traced
    from bench.speed.model import rank_memory, recipe_on, step_memory
    from bench.speed.profiles import shipped_gpus

    folder = Path(__file__).resolve().parents[1] / "results/tables/distributed_precision"
    records = {}
    for line in gzip.open(folder / "records.jsonl.gz", "rt"):
        record = json.loads(line)
        records.setdefault(json.dumps(record["config"]["parallel"], sort_keys=True), record)
    assert len(records) == 8
    for record in records.values():
        cfg = OmegaConf.create(record["config"])
        p, measured, trace = cfg.parallel, record["memory"]["step"]["total"], _traced(_rank_share(cfg))
        share = step_memory(trace, recipe_on(cfg, trace, shipped_gpus()["H100"]))  # of rank 0's share of the batch
        if p.name == "none":
            assert share["total"] == pytest.approx(measured, rel=1e-4)
            continue
        modelled = rank_memory(share, trace, p, cfg.model.task.blocks)
        if p.name == "ddp":
            assert modelled["total"] - modelled["communication_buffers"] == pytest.approx(measured, rel=1e-4)
        else:
            assert modelled["total"] == pytest.approx(measured, rel=0.07), p


def test_a_pre_emption_signal_landing_during_the_ranks_agreement_is_kept_for_the_next_step(tmp_path, monkeypatch):
    """The ranks stop on what each had read before their all-reduce of the flag: a signal that lands during it (the
    likeliest moment: a rank waits there for the slowest) must not be overwritten by the agreed 'no', or every rank
    trains on past its pre-emption. One rank in a gloo group of one, the all-reduce patched to be interrupted."""
    import signal

    import torch.distributed as dist

    from bench.running.checkpoint import DistributedCheckpointer

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        checkpointer = DistributedCheckpointer(tmp_path, "run", None, False, "run")
        stops, all_reduce = [], dist.all_reduce

        def interrupted(tensor, *args, **kwargs):
            done = all_reduce(tensor, *args, **kwargs)
            checkpointer._on_signal(signal.SIGTERM, None)  # the handler, as it runs when the C call returns
            return done

        monkeypatch.setattr(dist, "all_reduce", interrupted)
        monkeypatch.setattr(checkpointer, "_stop", lambda signum, save: stops.append(signum))
        checkpointer.after_step(1, save=lambda: None)
        assert stops == [] and checkpointer.preempted == signal.SIGTERM  # agreed 'no' this step; kept
        checkpointer.after_step(2, save=lambda: None)
        assert stops == [signal.SIGTERM]
    finally:
        dist.destroy_process_group()


def test_ranks_wanting_more_cores_than_the_machine_gives_are_warned_of_not_refused(make_cfg):
    two = make_cfg("model=lenet", "parallel=ddp", "device=cpu")
    assert parallel.oversubscribed(two, cores=2) is None
    assert parallel.oversubscribed(make_cfg("model=lenet", "parallel=ddp", "parallel.world_size=4", "device=cpu"),
                                   cores=2) == ("parallel.world_size=4 ranks of threads=1 want 4 cores; this machine "
                                                "gives 2: the ranks share cores (slower; step times of shared cores)")
    assert parallel.oversubscribed(make_cfg("model=lenet", "parallel=ddp", "threads=2", "device=cpu"), cores=2)


def test_the_collectives_a_rank_receives_are_the_ring_algorithms_bytes_at_the_profiles_bandwidth(make_cfg):
    """bench.speed.model.collectives against nccl-tests' bus-bandwidth arithmetic, by hand: an all-gather or a
    reduce-scatter of S bytes over n ranks takes S (n-1)/n / busbw, an all-reduce twice that; within 8 GPUs at the
    profile's NVLink figure (H100: 450 GB/s, the datasheet's 900 both ways), beyond them at its network's (50)."""
    from bench.reporting.predict_cells import _traced
    from bench.speed.model import collectives
    from bench.speed.profiles import gpu

    h100, trace = gpu("H100"), _traced(make_cfg("model=charlm"))
    assert (h100.nvlink_gb_s, h100.network_gb_s) == (450, 50)
    p, gemm = trace.parameters, sum(trace.gemm_weights.values())
    ddp = collectives(trace, make_cfg("parallel=ddp", "parallel.world_size=8").parallel, h100, 1.0, "h")
    assert ddp.received == {"all_reduce": 2 * 7 / 8 * p * 4} and ddp.over == "nvlink"
    last = p * 4 - 2**20  # the char-LM's gradients fill DDP's first bucket (1 MiB) and part of a second, the last
    assert 0 < last < 25 * 2**20 and ddp.seconds == pytest.approx(2 * 7 / 8 * p * 4 / 450e9)
    assert ddp.exposed == pytest.approx(2 * 7 / 8 * last / 450e9)  # ready only as the backward pass ends
    fsdp = make_cfg("parallel=fsdp2", "parallel.world_size=16", "parallel.param_dtype=bf16").parallel
    sent = collectives(trace, fsdp, h100, 0.0, "h")
    blocks = sum(n for name, n in trace.gemm_weights.items() if name.startswith("h."))  # gathered twice, the rest once
    assert sent.received == pytest.approx({"all_gather": 15 / 16 * (p + blocks) * 2,
                                           "reduce_scatter": 15 / 16 * p * 4})
    assert sent.over == "network"
    assert sent.exposed == sent.seconds == pytest.approx(15 / 16 * (3 * p + blocks) * 2 / 50e9)
    hidden = collectives(trace, fsdp, h100, 1.0, "h")  # compute covers all but the first block's gather
    block = sum(n for name, n in trace.gemm_weights.items() if name.startswith("h.0."))  # the blocks are alike
    assert hidden.exposed == pytest.approx(15 / 16 * block * 2 / 50e9) and hidden.exposed < sent.seconds / 4
    fp8 = collectives(trace, fsdp, h100, 1.0, "h", frozenset(trace.gemm_weights))
    assert fp8.received["all_gather"] == pytest.approx(15 / 16 * ((gemm + blocks) * 1 + (p - gemm) * 2))
    # and the exposed first gather brings that block's weights at a byte too (it was priced at param_dtype's width)
    assert fp8.exposed == pytest.approx(15 / 16 * block * 1 / 50e9)
    assert collectives(trace, make_cfg("parallel=ddp", "parallel.world_size=1").parallel, h100, 1.0, "h") is None


def test_ddps_last_bucket_is_what_its_first_and_full_buckets_leave():
    from bench.speed.model import ddp_last_bucket

    mib = 2**20
    assert [ddp_last_bucket(n * mib) / mib for n in (0.5, 1, 3, 26, 31, 51)] == [0.5, 1, 2, 25, 5, 25]


def test_the_predicted_collectives_are_the_bytes_the_fsdp2_ranks_handed_them(lenet_cells):
    """bench.predict's FSDP2 collectives against records at two ranks (each rank's bytes handed to each collective
    in its first step), as a ring moves them: an all-gather brings (n-1) shards like the one a rank hands, a
    reduce-scatter (n-1)/n of the whole gradient it is handed. The root module's parameters are gathered once, a
    block's twice: LeNet (all root; gathered twice, the model was 2x over) to the padding of its shards, the
    committed char-LM cells within 1.5% (a block's biases and norms counted with the root's)."""
    import gzip

    from bench.reporting.predict_cells import _rank_share, _traced
    from bench.speed.model import collectives
    from bench.speed.profiles import gpu

    folder = Path(__file__).resolve().parents[1] / "results/tables/distributed_precision"
    lenet = lenet_cells[1]["fsdp2"]
    trace, lenet_cfg = _traced(OmegaConf.create(lenet["config"])), OmegaConf.create(lenet["config"])
    received = collectives(trace, lenet_cfg.parallel, gpu("H100"), 1.0, None).received
    assert received["all_gather"] == pytest.approx(lenet["parallel"]["collective_bytes_first_step"]["all_gather"],
                                                   rel=0.01)
    checked = set()
    for line in gzip.open(folder / "records.jsonl.gz", "rt"):
        record = json.loads(line)
        cfg = OmegaConf.create(record["config"])
        if cfg.parallel.name != "fsdp2" or (key := json.dumps(record["config"]["parallel"])) in checked:
            continue
        checked.add(key)
        n, handed = cfg.parallel.world_size, record["parallel"]["collective_bytes_first_step"]
        trace = _traced(_rank_share(cfg))
        received = collectives(trace, cfg.parallel, gpu("H100"), 1.0, cfg.model.task.blocks).received
        assert received["all_gather"] == pytest.approx((n - 1) * handed["all_gather"], rel=0.015), key
        assert received["reduce_scatter"] == pytest.approx((n - 1) / n * handed["reduce_scatter"], rel=1e-3), key
    assert len(checked) == 4


def test_llama3_8b_on_eight_h100s_hides_its_collectives_and_an_fp8_all_gather_only_shrinks_them():
    """results/bench/llama3_8b_fsdp.md's arithmetic: torchtitan's FSDP2 setting on NVLink moves a tenth of a step's
    time in collectives, hidden but the first block's gather; gathering the Linear weights in FP8 cuts them by a
    quarter, the exposed first gather with them (it kept BF16's width), and the step by that alone."""
    import yaml

    from bench.data import DATA_DIR
    from bench.tools.speed_validation import llama_fsdp

    source = yaml.safe_load((DATA_DIR / "speed_figures.yaml").read_text())["sources"]["torchao_llama3_h100"]
    rows = {cells[0]: [float(c) for c in cells[1:5]] for line in llama_fsdp(source) if line.startswith("| ")
            and (cells := [c.strip() for c in line.strip("|").split("|")])[1][0].isdigit()}
    step, sent, exposed, _ = rows["bf16-mixed"]
    assert 0.05 < sent / step < 0.2 and exposed < 0.01 * step
    plain, gathered = rows["format=fp8 scaling=per_tensor"], rows["format=fp8 scaling=per_tensor, FP8 all-gather"]
    assert gathered[1] == pytest.approx(0.77 * plain[1], rel=0.05)
    assert gathered[2] < 0.6 * plain[2] and plain[0] - gathered[0] == pytest.approx(plain[2] - gathered[2], abs=1)


def test_a_forked_rank_takes_the_launchers_environment_and_directory_not_the_fork_servers(tmp_path, monkeypatch):
    """The fork server's environment is as it was when the process's first cell started it; a rank must see the
    launching process's as it is now (a test's variable, a sweep's), keeping the variables torch's launcher set."""
    from bench.running.parallel import Launcher

    monkeypatch.chdir(tmp_path)  # restored after the test, as is os.environ (replaced by a dict here)
    monkeypatch.setattr(os, "environ", {"STALE": "server's", "RANK": "1", "TORCHELASTIC_RUN_ID": "bench-1",
                                        "MASTER_PORT": "29500", "PATH": "/old", "NCCL_DEBUG": "WARN"})
    (tmp_path / "launcher").mkdir()
    launcher = {"PATH": "/bin", "NEW": "launcher's", "RANK": "0", "NCCL_DEBUG": "INFO"}
    Launcher(launcher, str(tmp_path / "launcher")).apply()
    assert os.environ == {"PATH": "/bin", "NEW": "launcher's", "RANK": "1", "TORCHELASTIC_RUN_ID": "bench-1",
                          "MASTER_PORT": "29500", "NCCL_DEBUG": "INFO"}
    assert os.getcwd() == str(tmp_path / "launcher")


@pytest.mark.slow
def test_a_compiled_distributed_cell_compiles_each_block_before_wrapping_and_trains_as_eager(make_cfg, text_file):
    """train.compile=true under FSDP2 (torchtitan's pattern): each of the char-LM's blocks compiled by inductor, then
    sharded; the record names them, counts dynamo's graphs and keeps the compile steps out of the step time. It trains
    as the eager cell does, to inductor's reordering of FP32 sums. A whole FSDP2 model compiled would have broken its
    graph at FSDP's hooks; a model without blocks is refused (the parametrised refusals above)."""
    from bench.running.run import run_cell

    data = ["model=charlm", "model.data.source=local", f"model.data.path={text_file}", "model.data.sha256=null",
            "model.iterations=8", "parallel=fsdp2"]
    eager, compiled = (run_cell(make_cfg(*data, f"train.compile={c}", f"experiment_name=compile_{c}"))
                       for c in ("false", "true"))
    assert eager["status"] == compiled["status"] == "ok", compiled.get("reason")
    assert compiled["parallel"]["compiled_blocks"] == ["h.0", "h.1", "h.2", "h.3"]
    assert eager["parallel"]["compiled_blocks"] == []
    said = compiled["env"]["compile"]
    assert said["per_block"] and said["graphs"] > 0 and said["graph_breaks"] == 0
    assert 1 in compiled["timing"]["compile"]["steps"]  # the first step after the memory-counted one compiled
    assert math.isclose(compiled["metrics"]["final_train_loss"], eager["metrics"]["final_train_loss"], rel_tol=1e-5)


def test_bench_predict_gathers_a_cells_converted_weights_in_fp8_where_it_asks():
    """bench.predict of a cell with parallel.fp8_all_gather=true prices its all-gathers at a byte a converted weight
    element: less received than the same cell gathering in FP32, the reduce-scatters the same; its communication
    buffers hold those weights at a byte."""
    import re

    from bench.reporting.predict_cells import rows
    from bench.speed.profiles import gpu

    def received(*extra):
        (row,) = rows(["model=charlm", "parallel=fsdp2", "parallel.world_size=4", "format=fp8", "scaling=per_tensor",
                       *extra], [gpu("H100")])
        found = re.findall(r"(all_gather|reduce_scatter|communication buffers) ([\d.e+-]+) MiB", row["note"])
        return {kind: float(mib) for kind, mib in found}

    plain, gathered = received(), received("parallel.fp8_all_gather=true")
    assert gathered["all_gather"] < 0.5 * plain["all_gather"] and gathered["reduce_scatter"] == plain["reduce_scatter"]
    # and the rank holds the gathered weights at a byte each (it held them in FP32: a newcomer's trial)
    assert gathered["communication buffers"] < 0.6 * plain["communication buffers"]


def test_bench_predicts_rows_name_what_tells_them_apart_beyond_model_format_and_scaling():
    """Rows of a sweep over parallel or optimiser keys read alike but for their memory and note: the `also set`
    column names the cell's other overrides (a newcomer could not tell bf16 gradient compression's row from
    FP32's)."""
    from bench.reporting.predict_cells import rows
    from bench.speed.profiles import gpu

    found = rows(["model=lenet", "parallel=ddp", "parallel.gradient_compression=none,bf16"], [gpu("H100")])
    assert [row["also set"] for row in found] == ["parallel=ddp, parallel.gradient_compression=none",
                                                  "parallel=ddp, parallel.gradient_compression=bf16"]
    # and the note says the types the collectives carry (FSDP2's gather in FP32 unless told: a newcomer's trial)
    assert "gradients all-reduced in fp32" in found[0]["note"] and "all-reduced in bf16" in found[1]["note"]
    (fsdp2,) = rows(["model=lenet", "parallel=fsdp2", "parallel.param_dtype=bf16"], [gpu("H100")])
    assert "parameters gathered in bf16, gradients reduced in fp32" in fsdp2["note"]
    # where the configs and plug-ins come from tells no row apart (every row repeated them: a newcomer's trial)
    plugin = Path(__file__).parent / "plugin"
    (mine,) = rows(["model=lenet", f"hydra.searchpath=[file://{plugin / 'conf'}]", "plugins=[]", "parallel=ddp"],
                   [gpu("H100")])
    assert mine["also set"] == "parallel=ddp"


def test_a_rank_that_refuses_the_cell_while_building_it_exits_2_as_a_one_device_cell_does(tmp_path):
    """A ConfigError a rank raises building the cell (here the text's sha256; a newcomer met a failed download,
    2026-11-30) was a failed job: rc 1 and a record. Now it is the ConfigError it was: exit 2, nothing written."""
    import subprocess
    import sys

    text = tmp_path / "other.txt"
    text.write_text("not the expected text\n" * 200)
    results = tmp_path / "results"
    said = subprocess.run([sys.executable, "-m", "bench.run", "model=charlm", "parallel=ddp", "parallel.world_size=2",
                           "model.data.source=local", f"model.data.path={text}", "train.max_steps=2",
                           f"results_dir={results}"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert said.returncode == 2, said.stderr[-2000:]
    assert f"config error: {text}: sha256" in said.stderr and "set model.data.sha256=null" in said.stderr
    assert "Traceback" not in said.stderr and said.stderr.count("sha256") <= 2, said.stderr  # said once, in its words
    assert not [p for p in results.rglob("*") if p.is_file()]


def test_a_masked_lms_ranks_weigh_their_unequal_shares_of_masked_positions_as_one_device_does(make_cfg, text_file):
    """Each rank's share of a masked-LM batch holds its own number of masked positions, so the mean of the ranks'
    means is not the batch's: each rank's loss is weighted by its share of them (`parallel.batch_weighted`), and two
    ranks train the one-device cell to the order of their sums (dropout off: every rank draws the same masks, one
    device one mask for the whole batch). Unit scaling's cross-entropy sums its gradient, which the ranks average
    alike: its logged loss alone is weighted (weighting its gradient too moves it)."""
    from bench.running.record import logged_losses
    from bench.running.run import run_cell

    data = ["model=bert_mlm_tiny", "model.data.source=local", f"model.data.path={text_file}", "model.data.sha256=null",
            "model.arch.dropout=0", "model.batch_size=8", "train.max_steps=3", "train.log_every=1"]
    for scaling, wrappers in (("none", ("ddp", "fsdp2")), ("unit", ("ddp",))):
        curves = {}
        for wrapper in ("none", *wrappers):
            cfg = make_cfg(*data, f"scaling={scaling}", f"parallel={wrapper}")
            assert run_cell(cfg)["status"] == "ok"
            curves[wrapper] = [loss for _, loss in logged_losses(Path(cfg.results_dir) / cfg.cell)]
        for wrapper in wrappers:  # FSDP2 warns that the model returned a view: the task changes none in place
            one, ranks = curves["none"], curves[wrapper]
            assert math.isclose(one[0], ranks[0], rel_tol=1e-6), (scaling, wrapper)  # the first: the batch's mean
            assert math.isclose(one[-1], ranks[-1], rel_tol=1e-6), (scaling, wrapper)


def test_a_share_without_loss_terms_weighs_nothing_and_sends_no_nan_backward(tmp_path):
    """A rank whose share of the batch holds no masked position has a NaN mean: it weighs zero, its gradient too."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for gradient_too in (True, False):
            empty = torch.tensor(float("nan"), requires_grad=True)
            weighted = parallel.batch_weighted(empty, torch.tensor(0), gradient_too)
            weighted.backward()
            assert weighted.item() == 0 and empty.grad.item() == 0
            whole = torch.tensor(2.5, requires_grad=True)
            assert parallel.batch_weighted(whole, torch.tensor(7), gradient_too).item() == 2.5  # one rank: as it is
    finally:
        dist.destroy_process_group()


def test_a_wrapper_named_alone_runs_one_rank_and_says_so(make_cfg, caplog):
    """`parallel.name=ddp` keeps parallel=none's world size (1): a real job of one rank, wrapped (the CUDA tests run
    one), which a newcomer took for the two ranks `parallel=ddp` brings; the log says which it is."""
    from bench.running.run import run_cell

    with caplog.at_level("WARNING"):
        record = run_cell(make_cfg("model=lenet", "parallel.name=ddp", "train.max_steps=1"))
    assert record["status"] == "ok" and record["parallel"]["world_size"] == 1
    assert "parallel.name=ddp with parallel.world_size=1 is a job of one rank" in caplog.text
