"""The tensor-core accumulation model (bench/numerics/tensor_cores.py) against real GPU outputs (Khattak & Mikaitis's
validation data: a committed subset always, the full sets where ../shared/reference/tensor-cores exists), and against
hand-made cases, each exposing one rule."""

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.errors import ConfigError
from bench.numerics.tensor_cores import dot, mma
from tests.conftest import eager_tensor_core_kernels

HERE = Path(__file__).parent
SUBSET = HERE / "data" / "tensor_cores" / "subset.npz"
FULL = HERE.parents[1] / "shared" / "reference" / "tensor-cores"
INPUTS = {"fp16": "fp16", "bf16": "bf16", "tf32": "tf32", "E4M3": "e4m3", "E5M2": "e5m2"}
# Sets the model does not reproduce (open, with the mismatches of the full 5,000 cases in docs/formats.md): FP8 with
# an FP16 output, on B200 (1,892 / 1,597 of E4M3's / E5M2's apart) and on H100, whose runs used C where its
# FP32-output runs did not (the README there says to ignore C for H100 FP8).
OPEN = {("B200", "E4M3", "fp16"), ("B200", "E5M2", "fp16"), ("H100", "E4M3", "fp16"), ("H100", "E5M2", "fp16")}


def _floats(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.float32).astype(np.float64))


def _replay(a, b, c, d, gpu: str, fmt: str, output: str) -> int:
    """Mismatches (by value, FP32 bits compared as floats) between the model and the GPU's D."""
    if gpu == "H100" and fmt in ("E4M3", "E5M2") and output == "fp32":
        c = torch.zeros_like(c)  # WGMMA with C = 0 (the data's README)
    if output == "fp16":
        c = c.to(torch.float16).to(torch.float64)
    got = mma(a, b, c, gpu=gpu, inputs=INPUTS[fmt], output=output).to(torch.float64)
    return int((got != d).sum())


def _subset_sets():
    data = np.load(SUBSET)
    for key in sorted(k[:-2] for k in data.files if k.endswith("_a")):
        gpu, fmt = key.split("_")
        for output in ("fp32", "fp16"):
            if f"{key}_d_{output}" in data.files:
                yield gpu, fmt, output, [_floats(data[f"{key}_{part}"]) for part in ("a", "b", "c", f"d_{output}")]


def test_the_committed_subset_replays_bit_for_bit_on_every_covered_set():
    """128 real cases per GPU, input format and output: 0 mismatches everywhere but the sets named open."""
    counts = {(gpu, fmt, output): _replay(*parts, gpu, fmt, output) for gpu, fmt, output, parts in _subset_sets()}
    assert len(counts) == 30
    assert {k: v for k, v in counts.items() if k not in OPEN and v} == {}
    assert all(counts[k] > 0 for k in OPEN)  # still open: a model that reproduces one moves it out of OPEN


def _text_floats(path: Path, binary: bool) -> torch.Tensor:
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    bits = np.array([[int(x, 2 if binary else 16) for x in row] for row in lines], dtype=np.uint32)
    return _floats(bits[:, 0] if binary else bits)


@pytest.mark.skipif(not FULL.is_dir(), reason="the full tensor-core data lives in ../shared/reference/tensor-cores")
def test_the_full_published_sets_replay_bit_for_bit_on_every_covered_set():
    """All 5,000 cases of every covered GPU, format and output: 0 mismatches."""
    for gpu_dir in sorted(p for p in FULL.iterdir() if p.is_dir()):
        gpu = gpu_dir.name
        for fmt_dir in sorted(gpu_dir.iterdir()):
            fmt = fmt_dir.name
            a, b = (_text_floats(fmt_dir / f"{x}_{gpu}_{fmt}.txt", binary=False) for x in "ab")
            c = _text_floats(fmt_dir / f"c_{gpu}_fp32.txt", binary=True)
            for output in ("fp32", "fp16"):
                path = fmt_dir / f"d_{gpu}_{output}.txt"
                if path.is_file() and (gpu, fmt, output) not in OPEN:
                    assert _replay(a, b, c, _text_floats(path, binary=True), gpu, fmt, output) == 0, (gpu, fmt, output)


def _one(products, c=0.0, gpu="H100", inputs="fp16", output="fp32"):
    """One step on operand pairs given as (a, b) values, exact in `inputs`."""
    a = torch.tensor([[x for x, _ in products]], dtype=torch.float64)
    b = torch.tensor([[y for _, y in products]], dtype=torch.float64)
    return mma(a, b, torch.tensor([c], dtype=torch.float64), gpu=gpu, inputs=inputs, output=output).item()


def test_small_terms_beside_a_large_one_are_truncated_at_alignment():
    """H100 FP16: 1 and fifteen products of 2^-26 (an exact sum of 1 + 1.875 ulp of FP32): aligned to 1's exponent
    with 25 fraction bits, each 2^-26 is cut to 0, so D = 1; FP32 arithmetic would give 1 + 2 ulps."""
    products = [(1.0, 1.0)] + [(2.0 ** -13, 2.0 ** -13)] * 15
    assert _one(products) == 1.0
    assert np.float32(1 + 15 * 2.0 ** -26) == np.float32(1 + 2 * 2.0 ** -23)
    assert _one([(2.0 ** -13, 2.0 ** -13)] * 15) == 15 * 2.0 ** -26  # alone, they align to their own exponent


def test_the_sum_is_rounded_toward_zero_where_nearest_would_round_up():
    """H100 FP16: 1 + (1 - 2^-11)^2 + 3 x 2^-24 = 2 - 2^-10 + 2^-22 + 2^-23 + 2^-24 sits exactly between two FP32
    values with an odd last bit: nearest-even rounds up, the tensor core truncates."""
    near = 1 - 2.0 ** -11
    products = [(1.0, 1.0), (near, near)] + [(2.0 ** -12, 2.0 ** -12)] * 3
    exact = 1 + near * near + 3 * 2.0 ** -24
    truncated = 2 - 2.0 ** -10 + 2.0 ** -22 + 2.0 ** -23
    assert _one(products) == truncated and float(np.float32(exact)) == truncated + 2.0 ** -23


def test_cancellation_keeps_only_what_survived_alignment():
    """1 - 1 + 2^-26: the large terms cancel exactly, but the small one was already cut at alignment to their
    exponent: D = 0 where the exact sum is 2^-26."""
    assert _one([(1.0, 1.0), (-1.0, 1.0), (2.0 ** -13, 2.0 ** -13)]) == 0.0


def test_subnormal_operands_are_exact_and_fp16_output_rounds_to_nearest():
    """FP16 subnormal inputs (2^-24 = the smallest) multiply exactly; an FP16 output rounds to nearest even."""
    assert _one([(2.0 ** -24, 1.0)]) == 2.0 ** -24
    assert _one([(1.0, 1.0), (2.0 ** -11, 1.0)], output="fp16") == 1.0  # a tie at half an FP16 ulp: to even (1)
    assert _one([(1.0, 1.0), (3 * 2.0 ** -11, 1.0)], output="fp16") == 1 + 2.0 ** -9  # 1.5 ulp: up to even


def test_fp8_keeps_13_fraction_bits_in_the_accumulator_on_hopper_not_on_blackwell():
    """E4M3: 1 and 2^-14 (the product of two 2^-7): Hopper's 13-bit accumulator drops it, Blackwell's keeps it."""
    products = [(1.0, 1.0), (2.0 ** -7, 2.0 ** -7)]
    assert _one(products, inputs="e4m3") == 1.0
    assert _one(products, gpu="B200", inputs="e4m3") == 1 + 2.0 ** -14


def test_blackwell_fp8_adds_c_after_rounding_its_products_toward_zero():
    """B200 FP8: the products' aligned sum is rounded toward zero to FP32, then C added by one addition rounded to
    nearest even (the published model aligns C with the products and truncates the sum: 1,793 of the 5,000 E4M3
    cases apart, now 0). E5M2 products 1 and 2^-24 sum to 1 + 2^-24, rounded to 1; with C = 2^-24, 1 + 2^-24 is a
    tie that rounds to even, 1, where C aligned with the products gives 1 + 2^-23. Hopper aligns C."""
    products = [(1.0, 1.0), (2.0 ** -12, 2.0 ** -12)]
    assert _one(products, c=2.0 ** -24, gpu="B200", inputs="e5m2") == 1.0
    assert _one(products, c=2.0 ** -24, gpu="H100", inputs="e5m2") == 1.0  # Hopper's 13 bits drop both
    assert _one(products, c=3 * 2.0 ** -24, gpu="B200", inputs="e5m2") == 1 + 2.0 ** -22  # 1 + 3/2 ulp: up to even
    assert _one([(1.0, 1.0)], c=2.0 ** -24 + 2.0 ** -40, gpu="B200", inputs="e5m2") == 1 + 2.0 ** -23  # past a tie


def test_a_long_k_chains_blocks_and_promotion_bounds_the_error():
    """K = 1,024 positive E4M3 products on the H100 model: fast accumulation loses far more than promotion into FP32
    every 128 elements; the interval changes the result; promotion at K or beyond is the fast path itself."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.rand(64, 1024, generator=g) for _ in range(2))
    import ml_dtypes

    a, b = (torch.from_numpy(x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float64)) for x in (a, b))
    exact = (a * b).sum(1)
    fast = dot(a, b, gpu="H100", inputs="e4m3")
    promoted = {n: dot(a, b, gpu="H100", inputs="e4m3", promote_every=n) for n in (128, 256, 1024)}
    error = {n: ((v.double() - exact).abs() / exact).max().item() for n, v in promoted.items()}
    assert ((fast.double() - exact).abs() / exact).max().item() > 10 * error[128]
    assert error[128] < error[256] and not torch.equal(promoted[128], promoted[256])
    assert torch.equal(promoted[1024], fast)


def test_a_pair_the_data_does_not_cover_is_refused_naming_the_covered_ones():
    with pytest.raises(ConfigError, match=r"no tensor-core model for V100 with bf16 inputs; covered: V100: fp16; "):
        mma(torch.ones(1, 4), torch.ones(1, 4), torch.zeros(1), gpu="V100", inputs="bf16")
    with pytest.raises(ConfigError, match="no tensor-core model for H900"):
        mma(torch.ones(1, 4), torch.ones(1, 4), torch.zeros(1), gpu="H900", inputs="fp16")


# An independent float64 form of the model (the one this module had before its integer kernel, itself replayed
# against the hardware): every product and aligned sum exact in float64, one case at a time over K.
def _exponent(x, floor):
    return torch.clamp(torch.frexp(x)[1].to(torch.float64) - 1, min=floor)


def _reference_step(a, b, c, core, output):
    from bench.numerics.tensor_cores import element

    products = a * b
    live = products != 0
    floor = element(core.inputs).emin
    exponents = torch.where(live, _exponent(a, floor) + _exponent(b, floor), torch.full_like(products, -1e9))
    c_exponent = torch.where(c != 0, _exponent(torch.where(c != 0, c, 1.0), -126), torch.full_like(c, -1e9))
    lowest = core.fp16_out_min_exponent if output == "fp16" and core.inputs == "fp16" else core.min_exponent
    largest = exponents.amax(dim=1) if core.c_after else torch.maximum(exponents.amax(dim=1), c_exponent)
    largest = torch.clamp(largest, min=lowest)
    quantum = torch.ldexp(torch.ones_like(largest), (largest - 23 - core.extra_bits).to(torch.int64))
    if core.c_after:  # the products rounded toward zero to FP32, then C added to nearest even
        products = _rounded(torch.trunc(products / quantum[:, None]).sum(dim=1) * quantum, "fp32", core)
        return (products + c).to(element(output).torch_dtype).double()
    value = (torch.trunc(products / quantum[:, None]).sum(dim=1) + torch.trunc(c / quantum)) * quantum
    return _rounded(value, output, core)


def _rounded(value, output, core):
    """value (float64, exact) rounded to the output as the step rounds: toward zero to FP32, to nearest to FP16."""
    from bench.numerics.tensor_cores import element

    fraction_bits = element(output).man_bits + (min(core.extra_bits, 0) if output == "fp32" else 0)
    emin, emax = element(output).emin, element(output).emax
    magnitude = value.abs()
    grid = torch.ldexp(torch.ones_like(value), (torch.clamp(_exponent(torch.where(magnitude > 0, magnitude, 1.0), emin),
                                                            min=emin) - fraction_bits).to(torch.int64))
    kept = (torch.trunc if output == "fp32" else torch.round)(magnitude / grid) * grid
    largest_value = (2 - 2.0 ** -fraction_bits) * 2.0 ** emax
    kept = torch.where(kept > largest_value, largest_value if output == "fp32" else float("inf"), kept)
    return torch.copysign(kept, value)


def _reference_dot(a, b, gpu, inputs, promote_every=None):
    from bench.numerics.tensor_cores import tensor_core

    core = tensor_core(gpu, inputs)
    a, b = a.double(), b.double()
    total = torch.zeros(a.shape[0], dtype=torch.float32)
    interval = promote_every or a.shape[1]
    for start in range(0, a.shape[1], interval):
        d = torch.zeros(a.shape[0], dtype=torch.float64)
        for s in range(start, min(start + interval, a.shape[1]), core.block):
            part = [torch.nn.functional.pad(x[:, s:s + core.block], (0, -x[:, s:s + core.block].shape[1] % core.block))
                    for x in (a, b)]
            d = _reference_step(*part, d, core, "fp32")
        total = d.float() if promote_every is None else total + d.float()
    return total


def _operands(fmt, rows, k, generator, spread=3.0):
    """Values exact in `fmt` over a wide exponent range, with zeros and (for FP8) subnormals among them."""
    from bench.numerics.formats import quantise_value

    x = torch.randn(rows, k, generator=generator) * torch.exp2(torch.randn(rows, k, generator=generator) * spread)
    x[torch.rand(rows, k, generator=generator) < 0.05] = 0
    return quantise_value(x, fmt)


@pytest.mark.parametrize("gpu,fmt,promote", [
    ("H100", "fp8_e4m3", None), ("H100", "fp8_e4m3", 128), ("H100", "fp8_e5m2", 64), ("Ada", "fp8_e4m3", None),
    ("H100", "bf16", None), ("A100", "fp16", None), ("A100", "tf32", None), ("B200", "bf16", None),
    ("V100", "fp16", None), ("B200", "fp8_e4m3", None), ("B200", "fp8_e5m2", 64)])
def test_a_whole_gemm_is_each_outputs_chain_of_steps_bit_for_bit(gpu, fmt, promote, monkeypatch):
    """matmul (rows in chunks, K padded to whole blocks) against the float64 model one output at a time, fast and
    promoted."""
    from bench.numerics import tensor_cores
    from bench.numerics.tensor_cores import input_type, matmul

    eager_tensor_core_kernels(monkeypatch)
    g = torch.Generator().manual_seed(7)
    a, b = _operands(fmt, 23, 200, g), _operands(fmt, 9, 200, g)
    monkeypatch.setattr(tensor_cores, "STEP_ELEMENTS", 32 * 9 * 5)  # chunks of 5 rows (and a last of 3)
    got = matmul(a, b, gpu=gpu, a_format=fmt, promote_every=promote)
    want = _reference_dot(a.repeat_interleave(9, 0), b.repeat(23, 1), gpu, input_type(fmt), promote).reshape(23, 9)
    assert torch.equal(got, want)
    assert not torch.equal(got, (a.double() @ b.double().t()).float())  # the model is not exact FP32 arithmetic


@pytest.mark.parametrize("gpu,fmt,k,promote", [("H100", "fp8_e4m3", 128, 64),
                                               pytest.param("B200", "fp8_e4m3", 128, None, marks=pytest.mark.slow)])
def test_the_compiled_kernels_are_the_eager_ones_bit_for_bit(gpu, fmt, k, promote, monkeypatch):
    """The kernels CPU and CUDA compile (torch.compile) against the eager ones, mixed FP8 operands too; Blackwell's
    FP8 (C added after) in the slow suite. H100's 16-bit operands and K past one group of 8 blocks, promoted or not,
    compiled: the slow suite's replay of the H100's own outputs below (this test at K = 320 on them cost 104 s on an
    empty inductor cache, for kernels that replay compiles anyway)."""
    from bench.numerics.tensor_cores import matmul

    g = torch.Generator().manual_seed(5)
    a, b = _operands(fmt, 48, k, g), _operands(fmt, 40, k, g)
    other = "fp8_e5m2" if fmt.startswith("fp8") else fmt
    compiled = [matmul(a, b, gpu=gpu, a_format=fmt, promote_every=promote),
                matmul(b, a, gpu=gpu, a_format=other, b_format=fmt)]
    eager_tensor_core_kernels(monkeypatch)
    assert torch.equal(compiled[0], matmul(a, b, gpu=gpu, a_format=fmt, promote_every=promote))
    assert torch.equal(compiled[1], matmul(b, a, gpu=gpu, a_format=other, b_format=fmt))


def test_mixed_fp8_operands_read_each_in_its_own_format(monkeypatch):
    """E5M2 x E4M3: values in both formats give the same D as E4M3 x E4M3 (one model, two splits), and an E5M2
    subnormal (2^-16, below E4M3's range) is read exactly, not flushed."""
    from bench.numerics.formats import quantise_value
    from bench.numerics.tensor_cores import matmul

    eager_tensor_core_kernels(monkeypatch)
    g = torch.Generator().manual_seed(3)
    both = quantise_value(quantise_value(torch.randn(8, 96, generator=g), "fp8_e5m2"), "fp8_e4m3")
    w = _operands("fp8_e4m3", 5, 96, g)
    assert torch.equal(matmul(both, w, gpu="H100", a_format="fp8_e5m2", b_format="fp8_e4m3"),
                       matmul(both, w, gpu="H100", a_format="fp8_e4m3"))
    tiny = torch.zeros(1, 32)
    tiny[0, 0] = 2.0 ** -16
    assert matmul(tiny, torch.ones(1, 32), gpu="H100", a_format="fp8_e5m2", b_format="fp8_e4m3").item() == 2.0 ** -16


def test_the_promotion_interval_must_be_whole_blocks():
    from bench.numerics.tensor_cores import matmul

    with pytest.raises(ConfigError, match="not a multiple of H100's 32-element block"):
        matmul(torch.ones(2, 64), torch.ones(2, 64), gpu="H100", a_format="fp8_e4m3", promote_every=48)


# GEMM outputs of a real H100 through cuBLAS (torch.mm, torch._scaled_mm), made by `python -m bench.tools.gpu_gemms
# capture` on 2026-11-27 (issue #49): 8 x 8 corners of GEMMs run at M = N = 4096 (and 16, where cuBLAS splits K)
H100_GEMMS = Path(__file__).parents[1] / "results/bench/cuda-nvidia-h100-80gb-hbm3-2026-11-27-gemm-outputs.npz"


def test_cublas_gemms_on_an_h100_match_the_model_bit_for_bit_at_a_training_size(monkeypatch):
    """K chained in order through the tensor cores, FP8 without fast accumulation promoted every 128 elements, the
    16-bit outputs rounded to nearest: every output of every setting (bf16, fp16, tf32, FP8 fast and promoted,
    E5M2 x E4M3) on normal, positive and large-first inputs, K from 32 to 8192. On the model's eager kernels: each
    of these 8 x 8 corners is one shape called once, 3 s in all eagerly where compiling them took 75-110 s on an empty
    inductor cache (the compiled kernels are held to the eager ones below, and replay the data in the slow suite)."""
    from bench.tools.gpu_gemms import replay

    eager_tensor_core_kernels(monkeypatch)
    counts = replay(H100_GEMMS, size=4096)
    assert len(counts) == 10 and all(total for _, total in counts.values())
    assert {setting: bad for setting, (bad, _) in counts.items() if bad} == {}


def test_the_h100_data_tells_the_promotion_interval_and_fast_accumulation_apart(monkeypatch):
    """The replay would notice a wrong model: promoting every 256 (or 64) elements, or not at all, misses."""
    from bench.tools.gpu_gemms import replay

    eager_tensor_core_kernels(monkeypatch)
    for promote in (64, 256, 10**6):
        counts = replay(H100_GEMMS, size=4096, max_k=512, promote_every=promote,
                        settings=("e4m3.slow", "e5m2xe4m3.slow", "e4m3.fast"))
        assert counts["e4m3.slow"][0] > 0 and counts["e5m2xe4m3.slow"][0] > 0, promote
        assert counts["e4m3.fast"][0] == 0  # fast accumulation never promotes


@pytest.mark.slow
def test_cublas_gemms_on_an_h100_match_the_model_compiled_up_to_k_8192():
    """The replay above on the kernels inductor compiles for the CPU (a compile per shape: minutes)."""
    from bench.tools.gpu_gemms import replay

    assert {s: bad for s, (bad, _) in replay(H100_GEMMS, size=4096).items() if bad} == {}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_model_compiled_for_the_gpu_reproduces_the_h100s_own_outputs():
    """The model's kernels as inductor builds them for CUDA (Triton) give cuBLAS's bits, as the CPU's do: every
    setting, up to K = 8192 (`pytest -m cuda` on a lent GPU; CI has none)."""
    from bench.tools.gpu_gemms import replay

    assert {s: bad for s, (bad, _) in replay(H100_GEMMS, size=4096, device="cuda").items() if bad} == {}
