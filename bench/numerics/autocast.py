"""BF16 autocast with its GEMMs emulated: format.elsewhere=bf16 on a CPU without BF16 units.

Under BF16 autocast a convolution or matmul outside the format's GEMMs (LeNet's convolutions in MXFP8, BERT's
attention products) runs in BF16. On a CPU without avx512_bf16 or amx_bf16, oneDNN's BF16 convolutions and torch's
BF16 matmuls ran 3-4x slower than their FP32 twins (LeNet's convolutions, 2-core Intel Xeon, docs/performance.md):
they, not the format's emulation, made an emulated MXFP8 LeNet step 2.5x an FP32 one. There `EmulatedGemms` takes
each such call and computes it as the native kernel does, in FP32 arithmetic: its floating-point inputs rounded to
BF16 (autocast's cast) and widened exactly, the product accumulated in FP32, the result rounded to BF16 and handed
on as a BF16 tensor, so every op after it runs as under native autocast. Its backward pass does the same by autograd:
the output gradient arrives in BF16, the FP32 GEMMs of the backward pass compute the input gradients, and the
widening's backward rounds them to BF16, as a BF16 kernel writes them.

What departs from a native BF16 kernel: the order in which FP32 accumulation adds the products (oneDNN's and the
BLAS's blocking; no kernel promises one order, and the native kernels of two CPUs differ alike); and, on a CPU with
AVX2 alone, oneDNN's BF16 convolution backward, which rounds partial sums (up to hundreds of BF16 units from the exact
result rounded once where sums cancel, docs/formats.md): the emulation rounds once, as a GPU's BF16 kernel does.
`F.scaled_dot_product_attention` is not taken: a BF16 attention kernel rounds its scores and probabilities inside,
at points an FP32 decomposition would not reproduce, so it runs natively (a transformer written with explicit
matmuls, as transformers' eager attention, gets its products emulated).
The plan decides it for the device (bench/numerics/plan.py), and Precision enters it only in a model with a Linear
or convolution layer that autocast computes (its cost, a Python call per torch call of the forward pass, is repaid
there; FP8's own emulated layers turn autocast off). The record says which ran (env.precision.elsewhere_emulated).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from bench.numerics.formats import rounded_through

# The Python functions that reach the ops CPU autocast computes in its lower-precision dtype (torch.amp's list for
# CPU: convolutions, linear, matmul, mm, bmm, baddbmm, addmm, addbmm), however a model spells them
LOWER_PRECISION_GEMMS = frozenset({
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.linear,
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm,
    torch.addmm, torch.Tensor.addmm, torch.addbmm, torch.Tensor.addbmm})
PLAIN = (torch.Tensor, torch.nn.Parameter)  # the operand types taken


class EmulatedGemms(TorchFunctionMode):
    """Inside an autocast region (and only there, as autocast itself), each LOWER_PRECISION_GEMMS call computed in
    FP32 on BF16-rounded operands and returned in BF16 (the module docstring). `on_operand(x, widened)`, if given,
    is told of each operand made (memory accounting counts what autograd saves at BF16's width)."""

    def __init__(self, device_type: str, on_operand=None):
        super().__init__()
        self.device_type, self.on_operand = device_type, on_operand

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in LOWER_PRECISION_GEMMS or not torch.is_autocast_enabled(self.device_type) or any(
                type(a) not in PLAIN for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)):
            return func(*args, **kwargs)  # a tensor subclass (torchao's FP8 weights) computes its own GEMM
        dtype = torch.get_autocast_dtype(self.device_type)
        with torch.autocast(self.device_type, enabled=False):
            result = func(*(self._widened(a, dtype) for a in args),  # each op takes its tensors as arguments
                          **{k: self._widened(v, dtype) for k, v in kwargs.items()})
        return result.to(dtype)

    def _widened(self, a, dtype: torch.dtype):
        """An operand as autocast casts it (a floating tensor other than float64, to `dtype`), widened to FP32."""
        if not isinstance(a, torch.Tensor) or not a.is_floating_point() or a.dtype == torch.float64:
            return a
        widened = rounded_through(a, dtype)  # in a compiled step too, whose inductor would drop a cast and back
        if self.on_operand is not None:
            self.on_operand(a, widened)
        return widened
