"""`make doctor`: a self-test to run on a new node before a sweep (well under 2 minutes).

    python -m bench.tools.doctor

Prints the device and its flags; for every precision setting the device claims to run natively, one training
step of a tiny model (pass/fail and step time), with fp32 checked against float64 so that TF32 is provably
off; whether W&B is online, offline or unreachable; which presets have their Hugging Face models and
datasets cached; the SLURM variables in the environment. Exits 1 if a path the device claims fails.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time

import torch
from hydra import compose, initialize_config_dir
from tabulate import tabulate
from torch import nn

from bench.data import hub
from bench.numerics import hardware, specs
from bench.numerics.plan import fp32_flags
from bench.numerics.precision import Precision
from bench.running import device as devices
from bench.running.config import CONF_DIR
from bench.tasks.charlm import text_cache
from bench.tools.matrix import settings


def fp32_is_ieee(device: torch.device) -> tuple[bool, str]:
    """A 512x512 matmul with TF32 off against float64: TF32 (10-bit mantissa inputs) would miss by ~1e-3."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(512, 512, generator=generator) for _ in range(2))
    with fp32_flags(tf32=False):  # as a 32-true cell runs
        ours = (a.to(device) @ b.to(device)).cpu().double()
    error = ((ours - a.double() @ b.double()).abs().max() / (a.double() @ b.double()).abs().max()).item()
    return error < 1e-5, f"max relative error vs float64 {error:.1e}"


def one_step(fmt: str, mode: str, device: torch.device) -> tuple[bool, str]:
    """Two training steps of a tiny MLP natively in (fmt, mode), under the flags a cell runs under; the second is
    timed."""
    try:
        precision = Precision.of(fmt, device, "per_tensor" if fmt == "fp8" else "none", mode=mode, backend="native")
        with precision.fp32_flags():
            loss, elapsed = _two_steps(precision, device)
        if not torch.isfinite(loss):
            return False, f"loss {loss.item()}"
        return True, f"{1e3 * elapsed:.2f} ms a step"
    except Exception as e:  # the point is to report it
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _two_steps(precision: Precision, device: torch.device) -> tuple[torch.Tensor, float]:
    torch.manual_seed(0)
    model = precision.prepare(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64, device=device), torch.randint(0, 16, (32,), device=device)
    for _ in range(2):
        start = time.perf_counter()
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(precision.inputs(x)).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        devices.synchronize(device)
        elapsed = time.perf_counter() - start
    return loss, elapsed


def precision_rows(device: torch.device) -> tuple[list[list[str]], bool]:
    rows, healthy = [], True
    ok, detail = fp32_is_ieee(device)
    rows.append(["32-true (TF32 off)", "native", "pass" if ok else "FAIL", detail])
    healthy &= ok
    for fmt, mode in settings():
        if fmt == "fp32":
            continue
        setting = f"{fmt}-{mode}" if fmt in ("fp16", "bf16") else fmt
        support = specs.native_support(fmt, device)
        if not support.available:
            rows.append([setting, "emulated", "–", support.why])
            continue
        ok, detail = one_step(fmt, mode, device)
        rows.append([setting, "native" if support.fast else "native (slow; auto emulates)",
                     "pass" if ok else "FAIL", f"{detail}; {support.why}"])
        healthy &= ok
    return rows, healthy


def wandb_state() -> str:
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        return f"{os.environ['WANDB_MODE']} (WANDB_MODE)"
    if not os.environ.get("WANDB_API_KEY"):
        return "offline (no WANDB_API_KEY: runs are kept locally; `make sync` uploads them later)"
    try:
        socket.create_connection(("api.wandb.ai", 443), timeout=3).close()
    except OSError as e:
        return f"unreachable ({type(e).__name__}): runs go offline, `make sync` later"
    return "online"


def preset_rows() -> list[list[str]]:
    """For every preset and the default: whether its hub models and datasets (or its downloaded text) are here."""
    reachable = hub.reachable()
    rows = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for preset in [None, *sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))]:
            cfg = compose("config", overrides=[f"experiment={preset}"] if preset else [])
            model = cfg.model
            needs = [("model", model.hub_name)] if model.get("pretrained") else []
            needs += [("dataset", model.data.name)] if model.data.source == "hub" else []
            missing = [name for kind, name in needs
                       if not (hub.model_cached(name) if kind == "model" else hub.dataset_cached(name))]
            state = "nothing to download" if not needs else ("cached" if not missing else
                                                            f"not cached: {', '.join(missing)}")
            if missing:
                state += " (the hub answers: it downloads)" if reachable else " (hub unreachable: `make prepare`)"
            if model.data.source == "download":  # a text file fetched from model.data.url (bench/tasks/charlm.py)
                state = (f"cached: {text_cache(model.data)}" if text_cache(model.data).is_file() else
                         f"not cached: downloads {model.data.url} on its first run (without internet: "
                         "model.data.source=local model.data.path=... a copy of it; other text also "
                         "model.data.sha256=null)")
            rows.append([preset or "default (make sweep)", state])
    return rows


def main() -> int:
    device = devices.select_device("auto")
    described = devices.describe(device)
    flags = sorted(hardware._cpu_flags() & {*hardware.CPU_16BIT_UNITS, "avx512f"})
    print(f"device: {device.type}, {described['device_name']}"
          + (f", compute capability {described['compute_capability']}" if described["compute_capability"] else "")
          + f"; CPU flags: {', '.join(flags) or 'no 16-bit units'}; torch {described['torch_version']}, "
          f"torchao {described['torchao_version'] or 'not installed'}")
    rows, healthy = precision_rows(device)
    print(tabulate(rows, headers=["setting", "path here", "step", "detail"], tablefmt="github"))
    print(f"\nW&B: {wandb_state()}")
    print(tabulate(preset_rows(), headers=["preset", "data and checkpoints"], tablefmt="github"))
    slurm = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM_")}
    print(f"\nSLURM: {', '.join(f'{k}={v}' for k, v in slurm.items()) or 'no SLURM_* variables (not in a job)'}; "
          f"sacct {'found' if shutil.which('sacct') else 'not found (submitit needs it to see jobs end)'}")
    print(f"\ndoctor: {'every native path this device claims works' if healthy else 'a native path FAILED'}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
