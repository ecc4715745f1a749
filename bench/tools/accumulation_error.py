"""The error of an FP8 GEMM's accumulation on a GPU's tensor cores, over K: DeepSeek-V3's figure (§3.3.2: a maximum
relative error of nearly 2% at K = 4096 on H800, which led them to promote partial sums to FP32 every 128 elements),
reproduced with bench/numerics/tensor_cores.py.

    python -m bench.tools.accumulation_error [--gpu H100] [--cases 500]

Per K (128 to 16,384) and input distribution, the dot products of E4M3 operands (cases x K, seeded) computed three
ways: exactly (float64), with the GPU's fast accumulation (K chained through the tensor cores' 13-bit accumulator)
and promoted every 128 elements into FP32. The error: |computed - exact| / sum |a_i b_i| (for positive operands, the
plain relative error). Writes results/bench/fp8_accumulation_error.{csv,md,png}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ml_dtypes
import numpy as np
import pandas as pd
import torch

from bench.numerics.tensor_cores import PROMOTION_INTERVAL, dot

OUT = Path(__file__).resolve().parents[2] / "results" / "bench" / "fp8_accumulation_error"
KS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DISTRIBUTIONS = {"uniform(0, 1)": lambda g, shape: torch.rand(shape, generator=g),
                 "normal(0, 1)": lambda g, shape: torch.randn(shape, generator=g)}


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """Values rounded to E4M3 (ml_dtypes, nearest even), held in float64."""
    return torch.from_numpy(x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float64))


def errors(gpu: str, cases: int, seed: int = 0) -> pd.DataFrame:
    rows = []
    for name, draw in DISTRIBUTIONS.items():
        generator = torch.Generator().manual_seed(seed)
        for k in KS:
            a, b = _e4m3(draw(generator, (cases, k))), _e4m3(draw(generator, (cases, k)))
            exact, scale = (a * b).sum(1), (a * b).abs().sum(1)
            for mode, promote in (("fast", None), (f"promoted every {PROMOTION_INTERVAL}", PROMOTION_INTERVAL)):
                error = (dot(a, b, gpu=gpu, inputs="e4m3", promote_every=promote).double() - exact).abs() / scale
                rows.append({"inputs": name, "K": k, "accumulation": mode, "max_error": error.max().item(),
                             "median_error": error.median().item()})
    return pd.DataFrame(rows)


def plot(frame: pd.DataFrame, gpu: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for (inputs, mode), part in frame.groupby(["inputs", "accumulation"], sort=False):
        ax.plot(part["K"], part["max_error"], marker="o" if mode == "fast" else "s",
                linestyle="-" if inputs.startswith("uniform") else "--", label=f"{mode}, {inputs} inputs")
    ax.axhline(0.02, color="grey", linewidth=0.8, linestyle=":")
    ax.annotate("DeepSeek-V3: ~2% at K = 4096 (H800)", (128, 0.02), textcoords="offset points", xytext=(2, 4),
                fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(KS, [str(k) for k in KS])
    ax.set_xlabel("K (elements summed)")
    ax.set_ylabel("max |error| / Σ|a·b| over cases")
    ax.set_title(f"E4M3 dot products, {gpu} tensor-core model: fast vs promoted")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.accumulation_error",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--cases", type=int, default=500)
    args = parser.parse_args(argv)
    frame = errors(args.gpu, args.cases)
    frame.to_csv(OUT.with_suffix(".csv"), index=False)
    shown = frame.assign(max_error=frame["max_error"].map("{:.2e}".format),
                         median_error=frame["median_error"].map("{:.2e}".format))
    OUT.with_suffix(".md").write_text(
        f"# FP8 (E4M3) accumulation error on {args.gpu}'s tensor cores, by the model "
        "(bench/numerics/tensor_cores.py)\n\n"
        f"Written by `python -m bench.tools.accumulation_error` ({args.cases} seeded cases per K and inputs). Error: "
        "|computed - exact| / Σ|a_i b_i|. Fast: K chained through the tensor cores' accumulator (13 fraction bits on "
        f"Hopper); promoted: every {PROMOTION_INTERVAL} elements into FP32 (an assumption about cuBLAS, not data).\n\n"
        + shown.to_markdown(index=False) + "\n")
    plot(frame, args.gpu, OUT.with_suffix(".png"))
    print(shown.to_markdown(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
