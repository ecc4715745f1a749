"""On a CUDA GPU, what its GEMMs compute and how long they take: the data the tensor-core model and the speed model
are checked against (issue #49). Two parts, each writing as it goes so that a run stopped at a time limit keeps what
it measured:

    python -m bench.tools.gpu_gemms capture OUT.npz   # GEMM outputs on adversarial inputs, for a CPU replay
    python -m bench.tools.gpu_gemms curve OUT.csv [--deadline S]   # GEMM and Linear times by shape and kernel
    python -m bench.tools.gpu_gemms replay OUT.npz   # on any machine: the captured outputs against our model

`capture` runs cuBLAS's GEMMs (torch.mm, torch._scaled_mm with fast accumulation on and off) on inputs made to
expose the accumulator: a large first term followed by small ones, sums of positive terms crossing powers of two,
and signed normals, at K from 32 to 8,192. Only an 8 x 8 corner of A and B is stored: each output depends only on
its row of A and column of B, so the GEMM can run at a training-like size (the rest random) and still be replayed
from the corner alone (`replay`, against bench.numerics.tensor_cores, on any machine). `curve` times single GEMMs
per kernel (bf16; FP8 tensor- and row-scaled, fast accumulation on and off) over M, K, N in {1024, ..., 16384} and
BERT-base's Linear shapes, then, until its deadline, one compiled Linear's forward and backward in bf16 and under
torchao's tensorwise and row-wise FP8 recipes (bench/tools/speed_validation.py scores the speed model on both).
On a machine without CUDA, capture and curve run on the CPU at small sizes (a smoke test of the plumbing).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.numerics import tensor_cores as tc
from bench.numerics.formats import quantise

KS = (32, 128, 512, 2048, 8192)  # the reduced dimension of each captured GEMM
CORNER = 8  # rows of A and columns of B stored per case
FAMILIES = ("normal", "positive", "large_first")
INPUTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "e4m3": torch.float8_e4m3fn,
          "e5m2": torch.float8_e5m2}
BITS = {torch.bfloat16: np.uint16, torch.float16: np.uint16, torch.float32: np.uint32, torch.float8_e4m3fn: np.uint8,
        torch.float8_e5m2: np.uint8}
TF32_MAX_K = 2048  # tf32 operands are 4 bytes: fewer of them keep the stored inputs to a few MB
# setting: (A's type, B's type, the call: mm, mm_fp32 (torch.mm's out_dtype), scaled_fast, scaled; output dtype)
SETTINGS = {"bf16.bf16out": ("bf16", "bf16", "mm", "bf16"), "bf16.fp32out": ("bf16", "bf16", "mm_fp32", "fp32"),
            "fp16.fp16out": ("fp16", "fp16", "mm", "fp16"), "fp16.fp32out": ("fp16", "fp16", "mm_fp32", "fp32"),
            "tf32.fp32out": ("tf32", "tf32", "mm", "fp32"),
            "e4m3.fast": ("e4m3", "e4m3", "scaled_fast", "fp32"), "e4m3.slow": ("e4m3", "e4m3", "scaled", "fp32"),
            "e5m2xe4m3.fast": ("e5m2", "e4m3", "scaled_fast", "fp32"),
            "e5m2xe4m3.slow": ("e5m2", "e4m3", "scaled", "fp32"),
            "e4m3.slow.bf16out": ("e4m3", "e4m3", "scaled", "bf16")}
OUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def corner(family: str, fmt: str, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored corner, A (CORNER x k) and B (k x CORNER), as float32 values exact in `fmt`, from a CPU generator."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(CORNER, k, generator=g), torch.randn(k, CORNER, generator=g)
    small = 0.125 if fmt != "e5m2" else 0.5
    if family == "positive":  # every partial sum grows: it crosses powers of two, where the alignment grid coarsens
        a, b = a.abs(), b.abs()
    elif family == "large_first":  # one product 2^10 first, then products near 2^-6 that alignment truncates
        a, b = a * small, b * small
        a[:, 0], b[0, :] = 32.0, 32.0
    return tuple(quantise(x, tc.element(fmt).name) for x in (a, b))


def _gemm(call: str, a: torch.Tensor, b: torch.Tensor, out: str) -> torch.Tensor:
    """a (M x K) @ b (K x N) in the operands' own types, as the setting's call runs it."""
    if call == "mm":
        return torch.mm(a, b)
    if call == "mm_fp32":
        return torch.mm(a, b, out_dtype=torch.float32)
    one = torch.ones((), device=a.device)
    return torch._scaled_mm(a, b.t().contiguous().t(), one, one, out_dtype=OUT_DTYPES[out],
                            use_fast_accum=call == "scaled_fast")


def capture(path: Path, sizes: tuple[int, ...]) -> None:
    """Every setting x family x K x padded size; an .npz of the corners' bits and the outputs (as float32)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True  # only the tf32 setting has FP32 operands
    arrays, seed = {}, 0
    inputs = {}
    for family in FAMILIES:
        for k in KS:
            seed += 1
            for fmt, dtype in INPUTS.items():
                if fmt == "tf32" and k > TF32_MAX_K:
                    continue
                a, b = corner(family, fmt, k, seed)
                inputs[fmt, family, k] = a, b
                for name, x in (("a", a), ("b", b)):
                    arrays[f"in/{fmt}/{family}/{k}/{name}"] = x.to(dtype).view(
                        {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.to(dtype).element_size()]).numpy()
    arrays["meta"] = np.array(json.dumps({
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "cuda": torch.version.cuda, "sizes": sizes, "settings": SETTINGS,
        "allow_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "allow_fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction}))
    for setting, (a_fmt, b_fmt, call, out) in SETTINGS.items():
        for (fmt, family, k), (a, _) in inputs.items():
            if fmt != a_fmt or (b_fmt, family, k) not in inputs:
                continue
            b = inputs[b_fmt, family, k][1]
            for size in sizes:
                g = torch.Generator(device=device).manual_seed(size + k)
                big_a = torch.randn(size, k, device=device, generator=g)
                big_b = torch.randn(k, size, device=device, generator=g)
                big_a[:CORNER], big_b[:, :CORNER] = a.to(device), b.to(device)
                try:
                    result = _gemm(call, big_a.to(INPUTS[a_fmt]), big_b.to(INPUTS[b_fmt]), out)
                except (RuntimeError, NotImplementedError) as error:  # a call this device's torch lacks: named
                    print(f"capture: {setting} at {size}x{k}: {str(error).splitlines()[0][:160]}", file=sys.stderr)
                    break
                arrays[f"out/{setting}/{family}/{k}/{size}"] = result[:CORNER, :CORNER].float().cpu().numpy()
        np.savez_compressed(path, **arrays)
        print(f"capture: {setting} done", flush=True)
    np.savez_compressed(path, **arrays)


def model_of(setting: str, a: torch.Tensor, b: torch.Tensor, gpu: str = "H100",
             promote_every: int = tc.PROMOTION_INTERVAL) -> torch.Tensor:
    """What the tensor-core model says `setting` computes for a (M x K) @ b (K x N): K chained in order through
    `gpu`'s tensor cores, FP8 without fast accumulation promoted to FP32 every `promote_every` elements, the output
    rounded to nearest even where it is 16-bit."""
    a_fmt, b_fmt, call, out = SETTINGS[setting]
    result = tc.matmul(a, b.t().contiguous(), gpu=gpu, a_format=tc.element(a_fmt).name, b_format=tc.element(b_fmt).name,
                       promote_every=promote_every if call == "scaled" else None)
    return result.to(OUT_DTYPES[out]).float()


def stored(data, fmt: str, family: str, k: int, name: str) -> torch.Tensor:
    """A stored corner operand (`capture`'s bits) as float32 values."""
    dtype = INPUTS[fmt]
    return torch.from_numpy(data[f"in/{fmt}/{family}/{k}/{name}"]).view(dtype).float()


def replay(path: Path, size: int, max_k: int | None = None, settings=SETTINGS, device: str = "cpu",
           **model) -> dict[str, tuple[int, int]]:
    """Per setting (of `settings`), (outputs whose bits differ from the model's, outputs) over the GEMMs captured at
    padded size `size` (and K <= max_k), the model run on `device`."""
    data = np.load(path)
    counts = {}
    for key in data.files:
        if not key.startswith("out/") or not key.endswith(f"/{size}"):
            continue
        _, setting, family, k, _ = key.split("/")
        if setting not in settings or (max_k is not None and int(k) > max_k):
            continue
        a_fmt, b_fmt, *_ = SETTINGS[setting]
        ours = model_of(setting, stored(data, a_fmt, family, k, "a").to(device),
                        stored(data, b_fmt, family, k, "b").to(device), **model).cpu()
        gpu = torch.from_numpy(data[key])
        bad, total = counts.get(setting, (0, 0))
        counts[setting] = bad + int((ours.view(torch.int32) != gpu.view(torch.int32)).sum()), total + gpu.numel()
    return counts


def _time(fn, device: torch.device, budget_s: float = 0.01) -> float:
    """Median seconds per call: a warm-up, then 3 rounds, each of as many calls as fill `budget_s`."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    calls = max(1, min(200, int(budget_s / max(time.perf_counter() - start, 1e-6))))
    rounds = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def _fp8_operands(m: int, k: int, n: int, device: torch.device, rowwise: bool):
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS's FP8 GEMM needs it
    if rowwise:
        return a, b, torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
    return a, b, torch.ones((), device=device), torch.ones((), device=device)


GEMM_KERNELS = ("bf16", "fp8_tensorwise_fast", "fp8_tensorwise", "fp8_rowwise_fast", "fp8_rowwise")


def gemm_call(kernel: str, m: int, k: int, n: int, device: torch.device):
    """A zero-argument call of one GEMM (M x K by K x N, output bf16) of `kernel`, its operands made once."""
    if kernel == "bf16":
        a, b = torch.randn(m, k, device=device, dtype=torch.bfloat16), torch.randn(k, n, device=device,
                                                                                   dtype=torch.bfloat16)
        return lambda: torch.mm(a, b)
    a, b, sa, sb = _fp8_operands(m, k, n, device, rowwise=kernel.startswith("fp8_rowwise"))
    fast = kernel.endswith("_fast")
    return lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)


LINEAR_RECIPES = ("bf16", "tensorwise", "rowwise")


def linear_step(recipe: str, m: int, k: int, n: int, device: torch.device):
    """One Linear (K -> N, bf16 weights, no bias) forward and backward on M tokens, compiled; under torchao's FP8
    recipe of that name where `recipe` is not bf16."""
    layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device=device, dtype=torch.bfloat16)
    if recipe != "bf16":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    layer = torch.compile(layer, dynamic=False)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    return lambda: layer(x).backward(grad)


CUBE = (1024, 2048, 4096, 8192, 16384)
BERT_BASE_TOKENS = 12 * 384  # batch 12 x 384 tokens, NVIDIA's SQuAD fine-tuning shape (the speed model's trace)
BERT_BASE_LINEARS = ((768, 768), (768, 3072), (3072, 768))  # (K, N): attention's four, the MLP's two
# the compiled Linears, in the order they are worth the time: BERT-base's own, then the cube's diagonal
LINEAR_SHAPES = [(BERT_BASE_TOKENS, k, n) for k, n in BERT_BASE_LINEARS] + [(s, s, s) for s in (4096, 8192, 16384,
                                                                                                 2048, 1024)]


def curve(path: Path, deadline_s: float, cube: tuple[int, ...], linear_shapes: list) -> None:
    """Rows (part, kernel, m, k, n, seconds, tflops) to `path`, GEMMs first, then compiled Linears until
    `deadline_s` from the start."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    torch._dynamo.config.cache_size_limit = 256  # a recompile per Linear shape and recipe is expected
    shapes = [(m, k, n) for m in cube for k in cube for n in cube]
    shapes += [(BERT_BASE_TOKENS, k, n) for k, n in BERT_BASE_LINEARS]
    shapes += [(BERT_BASE_TOKENS, n, k) for k, n in BERT_BASE_LINEARS]  # the backward's grad_input GEMMs
    shapes += [(n, BERT_BASE_TOKENS, k) for k, n in BERT_BASE_LINEARS]  # and grad_weight's
    with path.open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["part", "kernel", "m", "k", "n", "seconds", "tflops"])

        def write(part, kernel, m, k, n, seconds, flops):
            out.writerow([part, kernel, m, k, n, f"{seconds:.6e}", f"{flops / seconds / 1e12:.1f}"])
            handle.flush()

        for m, k, n in shapes:
            for kernel in GEMM_KERNELS:
                try:
                    write("gemm", kernel, m, k, n, _time(gemm_call(kernel, m, k, n, device), device), 2 * m * k * n)
                except (RuntimeError, NotImplementedError) as error:
                    print(f"curve: {kernel} {m}x{k}x{n}: {str(error).splitlines()[0][:160]}", file=sys.stderr)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"curve: GEMMs in {time.perf_counter() - started:.0f} s", flush=True)
        for m, k, n in linear_shapes:
            for recipe in LINEAR_RECIPES:
                if time.perf_counter() - started > deadline_s:
                    print("curve: deadline reached", flush=True)
                    return
                begun = time.perf_counter()
                try:
                    seconds = _time(linear_step(recipe, m, k, n, device), device)
                except Exception as error:  # noqa: BLE001 - a recipe this torch/torchao lacks: named, the rest runs
                    print(f"curve: linear {recipe} {m}x{k}x{n}: {str(error).splitlines()[0][:160]}", file=sys.stderr)
                    continue
                write("linear", recipe, m, k, n, seconds, 6 * m * k * n)
                print(f"curve: linear {recipe} {m}x{k}x{n} in {time.perf_counter() - begun:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.gpu_gemms", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    cap = sub.add_parser("capture", help="GEMM outputs on adversarial inputs (.npz)")
    cap.add_argument("out", type=Path)
    cap.add_argument("--sizes", default="16,4096", help="padded M = N at which each GEMM runs (default 16,4096)")
    rep = sub.add_parser("replay", help="the captured outputs against the tensor-core model (mismatches per setting)")
    rep.add_argument("data", type=Path)
    rep.add_argument("--gpu", default="H100")
    cur = sub.add_parser("curve", help="GEMM and compiled-Linear times (.csv)")
    cur.add_argument("out", type=Path)
    cur.add_argument("--deadline", type=float, default=150.0, help="seconds before no new Linear starts")
    cur.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    args = parser.parse_args(argv)
    if args.part == "replay":
        sizes = sorted({int(key.rsplit("/", 1)[1]) for key in np.load(args.data).files if key.startswith("out/")})
        for size in sizes:
            for setting, (bad, total) in replay(args.data, size, gpu=args.gpu).items():
                print(f"M = N = {size:5d}  {setting:18s} {bad:4d} of {total} outputs differ")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.part == "capture":
        capture(args.out, tuple(int(s) for s in args.sizes.split(",")))
    elif args.small:
        curve(args.out, args.deadline, (32, 64), [(64, 32, 32)])
    else:
        curve(args.out, args.deadline, CUBE, LINEAR_SHAPES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
