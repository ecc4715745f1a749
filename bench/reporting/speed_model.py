"""A roofline speed model: a transformer encoder's training step time on a GPU, predicted from its shapes.

Each op of the step takes max(FLOPs / achievable peak for its input dtype, bytes / achievable bandwidth): the
Linear layers' three GEMMs each (forward, input gradient, weight gradient), attention's two batched GEMMs, the
memory-bound rest (layer norms, softmax, GELU, residual adds, dropout; forward and backward) and the optimiser
step (AdamW: parameters, gradients, two moments). FP8 (torchao's tensorwise recipe) runs the Linears' GEMMs at the
FP8 peak and adds its casts: every GEMM operand's amax and cast (read twice in high precision, written once in
FP8), as torchao's benchmarks/float8/float8_roofline.py counts them. Compiled steps are the model's target: no
launch or Python overhead is counted, which is what eager torchao FP8 mostly is.

What it assumes, stated once: GEMMs reach GEMM_EFFICIENCY of the dense peak and memory-bound ops MEMORY_EFFICIENCY
of the bandwidth (a large cuBLAS GEMM reaches 70-80% of peak on an H100; elementwise kernels ~80% of HBM);
`elsewhere` is the precision of the memory-bound ops (FP32 for 32-true, TF32 and this suite's fp8-mixed, which
keeps everything outside the Linears in FP32; BF16 or FP16 for the 16-bit settings).
"""

from __future__ import annotations

from dataclasses import dataclass

GEMM_EFFICIENCY = 0.75
MEMORY_EFFICIENCY = 0.8

# Dense (not sparse) peak TFLOP/s by GEMM input dtype, and HBM bandwidth in TB/s, from NVIDIA's datasheets:
# V100 SXM2, A100 SXM4 80 GB, H100 SXM5, H200 SXM, B200 (HGX B200).
DEVICES = {
    "V100": {"tflops": {"fp32": 15.7, "fp16": 125.0}, "tb_s": 0.9,
             "source": "NVIDIA Tesla V100 datasheet (SXM2): 15.7 FP32, 125 tensor TFLOP/s, 900 GB/s"},
    "A100": {"tflops": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}, "tb_s": 2.039,
             "source": "NVIDIA A100 datasheet (80GB SXM): 19.5 FP32, 156 TF32, 312 BF16/FP16 dense, 2,039 GB/s"},
    "H100": {"tflops": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}, "tb_s": 3.35,
             "source": "NVIDIA H100 datasheet (SXM5): 67 FP32, 495 TF32, 989 BF16/FP16, 1,979 FP8 dense, 3.35 TB/s"},
    "H200": {"tflops": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}, "tb_s": 4.8,
             "source": "NVIDIA H200 datasheet (SXM): H100's compute, 4.8 TB/s HBM3e"},
    "B200": {"tflops": {"fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}, "tb_s": 8.0,
             "source": "NVIDIA HGX B200 datasheet per GPU: 80 FP32, 1.1 PF TF32, 2.25 PF BF16, 4.5 PF FP8 dense, 8 TB/s"},
}

# setting -> (GEMM dtype of the Linears, GEMM dtype of attention's batched GEMMs, bytes per element elsewhere,
# bytes per stored parameter/gradient)
SETTINGS = {
    "fp32": ("fp32", "fp32", 4, 4), "tf32": ("tf32", "tf32", 4, 4),
    "16-mixed": ("fp16", "fp16", 2, 4), "bf16-mixed": ("bf16", "bf16", 2, 4),
    "16-true": ("fp16", "fp16", 2, 2), "bf16-true": ("bf16", "bf16", 2, 2),
    "fp8": ("fp8", "fp32", 4, 4),  # this suite's fp8-mixed: torchao tensorwise, FP32 elsewhere
    "fp8-bf16-elsewhere": ("fp8", "bf16", 2, 4),  # torchao's and TE's recipes: BF16 autocast outside the Linears
}
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class Encoder:
    """A BERT-style encoder's training step: batch x seq tokens through `layers` layers of width `hidden`."""

    layers: int
    hidden: int
    heads: int
    intermediate: int
    seq: int
    batch: int
    vocab: int = 30522  # BERT's WordPiece vocabulary: its embedding is trained too (the optimiser step)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of every Linear: Q, K, V, output projection, the two feed-forward layers, per layer."""
        h, f = self.hidden, self.intermediate
        return [(h, h)] * 4 * self.layers + [(h, f), (f, h)] * self.layers

    def parameters(self) -> int:
        return (sum(i * o + o for i, o in self.linears()) + 4 * self.hidden * self.layers  # + layer norms
                + (self.vocab + self.seq) * self.hidden)  # + token and position embeddings


def gemm_seconds(m: int, k: int, n: int, dtype: str, out_bytes: int, device: dict) -> float:
    """One (m x k) @ (k x n) GEMM: max of its compute time and its memory time (operands read once, output written
    once)."""
    flops = 2 * m * k * n
    moved = (m * k + k * n) * DTYPE_BYTES[dtype] + m * n * out_bytes
    return max(flops / (device["tflops"][dtype] * 1e12 * GEMM_EFFICIENCY),
               moved / (device["tb_s"] * 1e12 * MEMORY_EFFICIENCY))


def memory_seconds(moved: float, device: dict) -> float:
    return moved / (device["tb_s"] * 1e12 * MEMORY_EFFICIENCY)


def step_seconds(model: Encoder, setting: str, device: dict) -> dict[str, float]:
    """Predicted seconds of one training step, by part: linears, casts (FP8), attention, elsewhere, optimiser."""
    linear_dtype, attention_dtype, elsewhere, stored = SETTINGS[setting]
    t, out_bytes = model.tokens, max(DTYPE_BYTES[attention_dtype], elsewhere)
    parts = {"linears": 0.0, "casts": 0.0}
    for k, n in model.linears():  # forward (t,k)x(k,n); input gradient (t,n)x(n,k); weight gradient (n,t)x(t,k)
        for m_, k_, n_ in ((t, k, n), (t, n, k), (n, t, k)):
            parts["linears"] += gemm_seconds(m_, k_, n_, linear_dtype, elsewhere, device)
        if linear_dtype == "fp8":  # amax + cast of input, weight and output gradient, for use and transposed use
            operands = t * k + k * n + t * n
            parts["casts"] += memory_seconds(2 * operands * (2 * elsewhere + 1), device)
    b_h, s, d = model.batch * model.heads, model.seq, model.hidden // model.heads
    # scores q k^T and context p v, forward and two backward GEMMs each, batched over batch x heads
    parts["attention"] = 3 * b_h * (gemm_seconds(s, d, s, attention_dtype, out_bytes, device)
                                    + gemm_seconds(s, s, d, attention_dtype, out_bytes, device))
    # per layer, elements read or written by the memory-bound ops, forward; the backward moves about twice that:
    # 2 layer norms and 2 residual adds over the hidden width (~12 passes), GELU and bias over the intermediate
    # (~4), softmax, mask and dropout over the scores (~6)
    per_layer = t * (12 * model.hidden + 4 * model.intermediate) + 6 * b_h * s * s
    parts["elsewhere"] = memory_seconds(3 * per_layer * model.layers * elsewhere, device)
    # AdamW: read parameter, gradient, two FP32 moments; write parameter and moments (mixed: FP32 masters)
    parts["optimiser"] = memory_seconds(model.parameters() * (2 * stored + stored + 4 * 4), device)
    parts["total"] = sum(parts.values())
    return parts


def predict(model: Encoder, device_name: str, settings=tuple(SETTINGS)) -> dict[str, dict[str, float]]:
    """{setting: {part: seconds, ..., "total", "speedup_vs_fp32", "speedup_vs_bf16-mixed"}} on a DEVICES entry."""
    device = DEVICES[device_name]
    out = {s: step_seconds(model, s, device) for s in settings if SETTINGS[s][0] in device["tflops"]
           and SETTINGS[s][1] in device["tflops"]}
    for parts in out.values():
        for baseline in ("fp32", "bf16-mixed"):
            if baseline in out:
                parts[f"speedup_vs_{baseline}"] = out[baseline]["total"] / parts["total"]
    return out
