"""What `format.backend=auto` decides on each device a cluster may have: `python -m bench.tools.matrix
[plugins=[module,...]]` (your formats and scaling methods beside the built-in ones, as bench.run names them; installed
plug-ins always).

The decision is `bench.numerics.precision.Precision`'s, asked on simulated devices (the CPU's flags, a CUDA compute
capability, whether torchao is installed, an XLA device), so the table below is what the code does, not a
description of it. docs/formats.md carries the table; a test keeps the two equal and checks every decision
against the rules written out by hand.
"""

from __future__ import annotations

import sys

from bench import plugins
from bench.errors import ConfigError
from bench.numerics import hardware
from bench.numerics.plan import PrecisionConfig, plan
from bench.numerics.scaling_methods import combining_with, scaling_class
from bench.numerics.specs import FORMAT_SPECS

# name -> (device type, CPU flags, CUDA compute capability, torchao installed)
PROFILES = {
    "CPU without 16-bit units": ("cpu", (), None, False),
    "CPU with avx512_bf16": ("cpu", ("avx512_bf16",), None, False),
    "CPU with AMX (bf16, fp16)": ("cpu", ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"), None, False),
    "V100 (7.0)": ("cuda", (), (7, 0), True),
    "A100 (8.0)": ("cuda", (), (8, 0), True),
    "H100 (9.0) without torchao": ("cuda", (), (9, 0), False),
    "H100 (9.0) with torchao": ("cuda", (), (9, 0), True),
    "B200 (10.0) with torchao": ("cuda", (), (10, 0), True),
    "TPU (torch_xla)": ("xla", (), None, False),
}


def settings() -> list[tuple[str, str]]:
    """(format, mode) of every registered format, in the registry's order."""
    return [(name, mode) for name, spec in FORMAT_SPECS.items() for mode in spec.modes]


def simulated(profile: str):
    """Within the block, bench.numerics.hardware answers as the named device would; yields its torch.device."""
    kind, flags, capability, torchao = PROFILES[profile]
    return hardware.simulated(kind, flags, capability, torchao)


# Settings whose backend depends on format options the columns leave at their defaults: (format, how the line
# names the cell, the options).
RECIPE_NOTES = [("mxfp8", "mxfp8-mixed with format.gradients=fp8_e4m3 format.scale_mode=rceil (torchao's MXFP8 recipe)",
                 {"gradients": "fp8_e4m3", "scale_mode": "rceil"})]


def decide(profile: str, fmt: str, mode: str, scaling: str, **options) -> tuple[str, str]:
    """(native | emulated, why) for one cell under format.backend=auto on a simulated device; `options`: more
    PrecisionConfig fields (gradients, scale_mode, rounding)."""
    with simulated(profile) as device:
        decided = plan(PrecisionConfig(fmt, mode, "auto", scaling=scaling, **options),
                       scaling_class(scaling)(name=scaling), device)
    return decided.backend, decided.why


def _summary(decisions: dict[str, str]) -> str:
    """One table cell: the backend, and the scaling methods that differ from the rest."""
    backends = set(decisions.values())
    if len(backends) == 1:
        return backends.pop()
    by_backend = {b: [s for s, backend in decisions.items() if backend == b] for b in ("native", "emulated")}
    fewer, other = sorted(by_backend, key=lambda b: len(by_backend[b]))
    return f"{fewer} with {', '.join(by_backend[fewer])}, else {other}"


def markdown() -> str:
    """The table: one row per device, one column per format setting."""
    columns = settings()
    header = "| device | " + " | ".join(FORMAT_SPECS[f].setting(m) for f, m in columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 1)]
    for profile in PROFILES:
        cells = [_summary({s: decide(profile, f, m, s)[0] for s in combining_with(FORMAT_SPECS[f])})
                 for f, m in columns]
        lines.append(f"| {profile} | " + " | ".join(cells) + " |")
    for fmt, cell, options in RECIPE_NOTES:
        native = [p for p in PROFILES if decide(p, fmt, "mixed", "none", **options)[0] == "native"]
        lines.append(f"\n{cell}: native on {', '.join(native) or 'none of these'}; emulated elsewhere.")
    native = [p for p in PROFILES if elsewhere_emulated(p) is None]
    lines.append(f"\nformat.elsewhere=bf16 (FP8's, MX's and NVFP4's default), autocast's own convolutions and matmuls "
                 f"(the layers the format leaves to it): torch's BF16 kernels on {', '.join(native)}; emulated on "
                 f"the others (FP32 on BF16-rounded operands, bench/numerics/autocast.py).")
    return "\n".join(lines)


def elsewhere_emulated(profile: str) -> str | None:
    """Why format.elsewhere=bf16's own GEMMs are emulated on a simulated device (None: native BF16 there)."""
    with simulated(profile) as device:
        return plan(PrecisionConfig("mxfp8", "mixed", "auto", elsewhere="bf16"), scaling_class("none")(name="none"),
                    device).elsewhere_emulated


def main(argv: list[str] | None = None) -> int:
    """Print the table, with the plug-ins `plugins=[...]` names; exit 2 naming the one argument taken otherwise."""
    modules = []
    for arg in sys.argv[1:] if argv is None else argv:
        key, _, value = arg.partition("=")
        if key != "plugins" or not value.strip("[]"):
            print(f"config error: {arg!r}: the one argument is plugins=[module,...] (your formats' and scaling "
                  "methods' modules, as bench.run names them)", file=sys.stderr)
            return 2
        modules += [m.strip() for m in value.strip("[]").split(",") if m.strip()]
    try:
        plugins.load(modules, named_by="the command line's plugins=")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
