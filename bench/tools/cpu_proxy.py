"""This CPU benchmarked as a stand-in for a CPU with less: `python -m bench.tools.benchmark --as-cpu <proxy>`.

The 2-core machines here come, by chance, as AMD EPYCs with AVX-512 and BF16 units, AMD EPYCs with AVX2 alone, and
Intel Xeons with AVX-512 and no BF16 units, and #56's targets must hold on each. On a machine with more, a run as
one with less is the nearest thing to measuring it. A proxy takes away, before torch starts (the benchmark runs
itself again with them set):
- ATen's kernels above the proxy's vector width (ATEN_CPU_CAPABILITY) and oneDNN's instructions above its ISA
  (ONEDNN_MAX_CPU_ISA);
- the flags the precision plan asks (bench.numerics.hardware): without BF16 units, format.elsewhere=bf16 emulates
  autocast's GEMMs in FP32, as it does on those machines;
- inductor's BF16 instructions (torch.cpu._is_avx512_bf16_supported) and, for AVX2, its AVX-512 code.
It is a proxy, not that machine: cores, clocks, caches and memory are this one's. Its JSON says so, in its name
(`<machine>-<this capability>-as-<proxy>`) and in env.cpu_proxy; docs/performance.md gives how far it has read
from each machine it stands for, measured at the same commit.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from bench.numerics import hardware


@dataclass(frozen=True)
class Proxy:
    aten: str  # ATEN_CPU_CAPABILITY: ATen's kernels and inductor's generated code
    onednn: str  # ONEDNN_MAX_CPU_ISA
    needs: str  # the CPU flag this machine must have to stand for it
    stands_for: str

    def keeps(self, flag: str) -> bool:
        """Whether the proxy's CPU has `flag` (of this machine's): no 16-bit units, no AMX, no AVX-512 under AVX2."""
        if flag in hardware.CPU_16BIT_UNITS or flag.startswith("amx"):
            return False
        return self.aten != "avx2" or not flag.startswith("avx512")


PROXIES = {
    "avx2": Proxy("avx2", "AVX2", "avx2", "the AMD EPYCs with AVX2 alone"),
    "avx512-no-bf16": Proxy("avx512", "AVX512_CORE", "avx512f", "the Intel Xeons with AVX-512 and no BF16 units"),
}
ACTIVE = "PRECISION_BENCH_CPU_PROXY"  # set in the run the proxy re-executes: its name


def check(name: str) -> str | None:
    """Why this machine cannot stand for proxy `name` (of PROXIES; None: it can)."""
    if PROXIES[name].needs not in hardware._cpu_flags():
        return f"--as-cpu {name} needs a CPU with {PROXIES[name].needs}; this one lacks it"
    return None


def reexecute_as(name: str, argv: list[str]) -> None:
    """Run `python -m bench.tools.benchmark argv` again in this process's place, with the proxy's variables set
    before torch reads them. Does not return."""
    proxy = PROXIES[name]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": proxy.aten, "ONEDNN_MAX_CPU_ISA": proxy.onednn, ACTIVE: name}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "bench.tools.benchmark", *argv], env)


def apply(name: str) -> dict:
    """In the re-executed run: take the proxy's flags from the plan's probes and inductor's BF16 instructions away.
    Returns what env.cpu_proxy records."""
    import torch

    proxy = PROXIES[name]
    flags = hardware._cpu_flags()
    hardware._cpu_flags = lambda: frozenset(flag for flag in flags if proxy.keeps(flag))
    torch.cpu._is_avx512_bf16_supported = lambda: False
    return {"as": name, "stands_for": proxy.stands_for, "on": "avx512" if "avx512f" in flags else "avx2",
            "aten_cpu_capability": proxy.aten, "onednn_max_cpu_isa": proxy.onednn,
            "flags_taken_away": sorted(flag for flag in flags if not proxy.keeps(flag))}
