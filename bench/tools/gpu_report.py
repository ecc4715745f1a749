"""`make gpu-report`: the GPU checks of the suite's time answer in one command, for a machine lent for minutes.

    python -m bench.tools.gpu_report [--dry-run]

On a CUDA machine, in turn, each under its own time limit (9 minutes in all, for a GPU lent for 15): the GPU's
GEMM outputs on adversarial inputs, for the CPU replay of the tensor-core model (bench.tools.gpu_gemms capture); the
GEMM curve per kernel and one compiled Linear per FP8 recipe (gpu_gemms curve); `make bench`'s native rows, eager
and compiled, for the pairs the issue's goals compare (bf16-true against fp32 on DistilBERT at Raschka's shape, FP8
with BF16 elsewhere against bf16-mixed on BERT-base at NVIDIA's), then its harness (LeNet's launch-bound step) and
host-sync rows; a short compiled run of Raschka's DistilBERT shape (6 x 768, sequences of 512) on the shipped IMDb
fixture in fp32, bf16-mixed and FP8, then its tables under results/tables/<device>/. Each step writes as it goes
(results/bench/cuda-<device>-<date>*). A step that fails or runs out of time is reported (its process group killed:
no compile worker or launcher job is left on the GPU to disturb the next step) and the next one runs; the exit code
is 1 if any did. On a machine without CUDA it prints what it would run and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import re
import signal
import subprocess
import sys
import time

import torch

RASCHKA_SHAPE = ["model=distilbert_tiny", "model.arch.layers=6", "model.arch.hidden=768", "model.arch.heads=12",
                 "model.arch.intermediate=3072", "model.max_length=512", "model.batch_size=12"]
RUNS = "results/runs/gpu-report"
# the native rows the goals compare: bf16-true against fp32 (Raschka's 4.17x) on DistilBERT, FP8 as torchao trains
# it against bf16-mixed on BERT-base; every other pair costs a compile, which a 9-minute report cannot spare
NATIVE_CELLS = ("distilbert:fp32", "distilbert:bf16-true", "bert_base:bf16-mixed", "bert_base:fp8-bf16-elsewhere")


def device_slug() -> str:
    """The device's name as results/ folders spell it (bench.tools.benchmark's JSON names it the same way)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def steps(python: str = sys.executable) -> list[tuple[str, list[str], int]]:
    """(what, command, seconds allowed)."""
    stem = f"results/bench/cuda-{device_slug()}-{dt.date.today().isoformat()}"
    return [
        ("GEMM outputs for the tensor-core replay",
         [python, "-m", "bench.tools.gpu_gemms", "capture", f"{stem}-gemm-outputs.npz"], 60),
        ("GEMM curve and compiled Linears",
         [python, "-m", "bench.tools.gpu_gemms", "curve", f"{stem}-gemm-curve.csv", "--deadline", "130"], 170),
        ("native rows eager and compiled, harness, host syncs",
         [python, "-m", "bench.tools.benchmark", "--out", "results/bench", "--only", "native,harness,host_syncs",
          "--repeats", "3", "--native-cells", ",".join(NATIVE_CELLS)], 200),
        ("compiled Raschka-shape run", [python, "-m", "bench.run", "-m", *RASCHKA_SHAPE, "format=fp32,bf16,fp8",
                                        "train.compile=true", "train.max_steps=40", "experiment_name=gpu_report",
                                        f"results_dir={RUNS}"], 90),
        ("its tables", [python, "-m", "bench.aggregate", RUNS, "--out", f"results/tables/{device_slug()}"], 20),
    ]


def run_step(command: list[str], limit: float) -> int | str:
    """Run one step in its own process group; past `limit` seconds, end the whole group (inductor's compile
    workers and a launcher's jobs too, which would otherwise hold the GPU through the next step's timings)."""
    process = subprocess.Popen(command, start_new_session=True)
    try:
        return process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)  # the step's whole group: a sweep saves what it can on SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever of the group outlived SIGTERM
        process.wait()
        return "timed out"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.gpu_report", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    args = parser.parse_args(argv)
    plan = steps()
    if args.dry_run or not torch.cuda.is_available():
        why = "--dry-run" if args.dry_run else "no CUDA device here"
        print(f"gpu-report ({why}): on a CUDA machine it would run, in about "
              f"{sum(limit for *_, limit in plan) // 60} minutes:")
        for what, command, limit in plan:
            print(f"  {what} (at most {limit} s): {' '.join(command)}")
        return 0
    failed = []
    for what, command, limit in plan:
        started = time.perf_counter()
        print(f"gpu-report: {what}: {' '.join(command)}", flush=True)
        code = run_step(command, limit)
        print(f"gpu-report: {what}: {'ok' if code == 0 else code} in {time.perf_counter() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(what)
    print("gpu-report: " + (f"failed: {', '.join(failed)}" if failed else "every step ran"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
