"""GPU profiles: what the speed model knows of a GPU, as data (bench/data/gpus/<name>.yaml, each figure with its
source). A profile of your own is a yaml path where a name is asked for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.data import DATA_DIR
from bench.errors import ConfigError

GPUS_DIR = DATA_DIR / "gpus"
FIELDS = ("name", "device_name", "compute_capability", "tflops", "tb_s", "source", "sms", "gemm_tiles",
          "gemm_efficiency", "attention_efficiency", "efficiency_source")


@dataclass(frozen=True)
class GPU:
    """A GPU profile: dense peak TFLOP/s by GEMM input type, HBM TB/s, the compute capability the runner decides
    native paths by, and what the GEMM model needs (bench/speed/gemm.py): SMs, tile shapes, and the fraction of each
    tensor-core type's peak a large GEMM reaches; with the datasheets and benchmarks the figures come from."""

    name: str
    device_name: str  # how torch names it (the start of torch.cuda.get_device_name): pairs measurements with it
    compute_capability: tuple[int, int]
    tflops: dict
    tb_s: float
    source: str
    sms: int
    gemm_tiles: tuple[tuple[int, int], ...]
    gemm_efficiency: dict  # tensor-core type -> fraction of its dense peak a full wave of GEMM tiles reaches
    attention_efficiency: float  # of the 16-bit peak a fused attention kernel (FlashAttention's) reaches
    efficiency_source: str
    # the collectives' bus bandwidth, GB/s: within a node (NVLink, one direction) and across nodes (the network, a
    # GPU's share); None in a profile without them: a distributed cell's collectives are then not priced
    nvlink_gb_s: float | None = None
    network_gb_s: float | None = None
    interconnect_source: str | None = None

    @classmethod
    def load(cls, path: Path) -> "GPU":
        data = yaml.safe_load(Path(path).read_text())
        missing = [k for k in FIELDS if k not in data]
        if missing:
            raise ConfigError(f"GPU profile {path}: missing {', '.join(missing)} (see {GPUS_DIR / 'h100.yaml'})")
        return cls(data["name"], data["device_name"], tuple(data["compute_capability"]),
                   {k: float(v) for k, v in data["tflops"].items()}, float(data["tb_s"]), data["source"],
                   int(data["sms"]), tuple(tuple(int(x) for x in t) for t in data["gemm_tiles"]),
                   {k: float(v) for k, v in data["gemm_efficiency"].items()}, float(data["attention_efficiency"]),
                   data["efficiency_source"], data.get("nvlink_gb_s"), data.get("network_gb_s"),
                   data.get("interconnect_source"))


def shipped_gpus() -> dict[str, GPU]:
    """The GPU profiles the suite ships, by name, in order of compute capability."""
    gpus = [GPU.load(p) for p in sorted(GPUS_DIR.glob("*.yaml"))]
    return {g.name: g for g in sorted(gpus, key=lambda g: (g.compute_capability, g.tb_s))}


def gpu(name: str) -> GPU:
    """A shipped profile by name (any case), or a profile of your own by its yaml path; ConfigError naming the
    known ones otherwise."""
    if name.endswith((".yaml", ".yml")):
        if not Path(name).is_file():
            raise ConfigError(f"GPU profile {name}: no such file")
        return GPU.load(Path(name))
    known = shipped_gpus()
    for key, profile in known.items():
        if key.lower() == name.lower():
            return profile
    raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(known)} (or a profile's yaml path)")
