"""How the error of a gradient average reduced in a low-precision type grows with the number of ranks.

    python -m bench.tools.reduction_error [--world-sizes 2,4,8,16] [--elements 65536] [--out results/bench]

A 2-rank cell (experiment=distributed_precision) reduces two summands; a 1,000-rank job reduces a thousand, in an
order the collective library chooses. This measures the reduction alone, as the cells' DDP hook runs it (each rank's
FP32 values divided by the world size, cast, all-reduced by gloo in that type, cast back), at each world size: ranks
spawned on this machine, every rank's values drawn from one seeded normal distribution (unit scale: the relative
error does not depend on it), the exact average taken in FP64 of the FP32 values. Per world size and type: the
relative RMS error over the elements, and the same for the rounding of the inputs alone (each rank's share cast to
the type and summed exactly), so that what the summation adds is seen apart from what the cast costs. Writes
`<out>/reduction_error.csv` and prints it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from bench.running.parallel import COMMUNICATED

TYPES = [name for name in COMMUNICATED if COMMUNICATED[name] != torch.float32]


def _values(rank: int, elements: int, seed: int) -> torch.Tensor:
    return torch.randn(elements, generator=torch.Generator().manual_seed(seed * 1_000 + rank))


def _rank(rank: int, world: int, store: str, elements: int, seed: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    results = {}
    for name in TYPES:
        sent = (_values(rank, elements, seed) / world).to(COMMUNICATED[name])
        dist.all_reduce(sent)
        results[name] = sent.float()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def measure(world: int, elements: int, seed: int = 0) -> list[dict]:
    """The rows for one world size."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/reduced.pt"
        torch.multiprocessing.spawn(_rank, args=(world, f"{tmp}/store", elements, seed, out), nprocs=world)
        reduced = torch.load(out)
    shares = [_values(rank, elements, seed).double() / world for rank in range(world)]
    exact = torch.stack(shares).sum(0)
    scale = exact.square().mean().sqrt()
    rows = []
    for name in TYPES:
        cast_only = torch.stack([s.float().to(COMMUNICATED[name]).double() for s in shares]).sum(0)
        rows.append({"world_size": world, "type": name, "elements": elements,
                     "relative_rms_error": float((reduced[name].double() - exact).square().mean().sqrt() / scale),
                     "of_which_inputs_cast": float((cast_only - exact).square().mean().sqrt() / scale)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.reduction_error", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8,16")
    parser.add_argument("--elements", type=int, default=1 << 16)
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    args = parser.parse_args(argv)
    rows = [row for world in map(int, args.world_sizes.split(",")) for row in measure(world, args.elements)]
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "reduction_error.csv", index=False)
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
