"""Emulated operands: how an emulated Linear or Conv2d rounds what enters and leaves it (TensorSite, OpCasts, the
Emulated* modules; accumulated exactly, each layer one autograd node, _EmulatedOp), and the block-scaled GEMM
operands of the MX, NVFP4 and FP8 row/tile formats (BlockOperands, FP8TileOperands, _BlockLinear). The precision
policy (precision.py) decides which of them a run uses."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bench.numerics.blocks import (
    TileScaling,
    mx_quantise,
    nvfp4_quantise,
    nvfp4_tensor_scale,
    nvfp4_tile_quantise,
    random_hadamard_transform,
    rowwise_quantise,
    te_nvfp4_quantise,
    te_nvfp4_tile_quantise,
    tile2d_quantise,
    tile_quantise,
)
from bench.numerics.formats import (
    FORMATS,
    ElementFormat,
    quantise_stochastic,
    quantise_value,
    resolve_overflow,
    rounded_through,
)
from bench.numerics.fused import Passes, in_graph
from bench.numerics.specs import Recipe
from bench.numerics.telemetry import QuantTelemetry
from bench.numerics.tensor_cores import Accumulation, matmul


class TensorSite:
    """Rounds one stream of tensors (say, conv1's weight) to an element format; optionally per-tensor scaled."""

    def __init__(self, tensor_class: str, fmt: str, overflow: str | None, ftz: bool,
                 telemetry: QuantTelemetry, scaler=None, listener: Callable[[], Callable | None] | None = None,
                 rounding: str = "nearest"):
        """listener(): who listens now, if anyone (bench/numerics/memory.py while it counts a step), told
        (input, output, tensor_class, fmt) of every tensor the site makes.
        rounding: nearest (RNE) or stochastic (bench.numerics.formats.quantise_stochastic, the same overflow policy)."""
        self.tensor_class = tensor_class
        self.rounding = rounding
        self.listener = listener
        self.spec = FORMATS[fmt]
        self.overflow = resolve_overflow(self.spec, overflow)
        self.ftz = ftz
        self.telemetry = telemetry
        self.scaler = scaler  # a bench.numerics.scaling.PerTensorScale, or None
        self.last_scale: torch.Tensor | None = None  # the scale of the tensor made last (a tensor-core GEMM reads it)
        # a site rounds the same stream every step: its compiled graph kept at hand (bench/numerics/fused.py's Bound)
        self._nearest = quantise_value.bind(self.spec, self.overflow, self.ftz)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            self.telemetry.observe(self.tensor_class, x, self.spec)
            rounded = self._round(x)
        else:
            scale = self.last_scale = self.scaler.scale_for(x)
            scaled = x * scale
            self.telemetry.observe(self.tensor_class, scaled, self.spec)
            rounded = self._round(scaled) / scale
        listening = None if self.listener is None else self.listener()
        if listening is not None:
            listening(x, rounded, self.tensor_class, self.spec.name)
        return rounded

    def listened(self) -> bool:
        """Whether someone listens to the site's roundings now (a memory count: bench/numerics/memory.py)."""
        return self.listener is not None and self.listener() is not None

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        if self.rounding == "nearest":
            return self._nearest(x)
        return quantise_stochastic(x, self.spec, overflow=self.overflow, ftz=self.ftz)  # the run's seeded generator


class _Cast(torch.autograd.Function):
    """Identity up to rounding: `forward_site` rounds the value, `backward_site` the gradient. With a `dtype` the
    value is handed on in it (an emulated GEMM's FP32 result in autocast's BF16) and its gradient comes back widened
    to the input's dtype before it is rounded: one node, not a rounding and a cast."""

    @staticmethod
    def forward(ctx, x, forward_site, backward_site, dtype=None):
        ctx.backward_site, ctx.input_dtype = backward_site, x.dtype
        y = x if forward_site is None else forward_site(x)
        return y if dtype is None else y.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        site, grad = ctx.backward_site, grad.to(ctx.input_dtype)
        return (grad if site is None else site(grad)), None, None, None


def cast(x: torch.Tensor | None, forward_site: TensorSite | None, backward_site: TensorSite | None,
         dtype: torch.dtype | None = None):
    if x is None or (forward_site is None and backward_site is None):
        return x if x is None or dtype is None else x.to(dtype)
    return _Cast.apply(x, forward_site, backward_site, dtype)


def _widened(*tensors) -> tuple:
    """Floating tensors in FP32 (a 16-bit one widened, exactly), the rest (None among them) as they are."""
    return tuple([t if t is None or not t.is_floating_point() else t.float() for t in tensors])


def _rounded_inputs(casts: "OpCasts", widen: bool, x, weight, bias) -> tuple:
    """An op's inputs as its sites round them: x, weight, bias in that order; with `widen` (under autocast) a 16-bit
    input widened to FP32 first."""
    if widen:
        x, weight, bias = _widened(x, weight, bias)
    return tuple(t if t is None or site is None else site(t)
                 for t, site in ((x, casts.activation), (weight, casts.weight), (bias, casts.bias)))


def _rounded_gradients(casts: "OpCasts", wanted: tuple[bool, bool, bool], grad_x, grad_weight, grad_bias) -> tuple:
    """The gradients an op returns for x, weight and bias, rounded by their sites (a 16-bit kernel's) in the order
    autograd ran three cast nodes made one after another: bias, weight, x (the last made first), so that a stochastic
    rounding draws what it drew then. A gradient nobody wants is not rounded (no draws)."""
    rounded = {}
    for name, grad, site, want in (("bias", grad_bias, casts.grad_bias, wanted[2]),
                                   ("weight", grad_weight, casts.grad_weight, wanted[1]),
                                   ("x", grad_x, casts.grad_activation, wanted[0])):
        rounded[name] = None if grad is None or not want else grad if site is None else site(grad)
    return rounded["x"], rounded["weight"], rounded["bias"]


class _InputCasts(torch.autograd.Function):
    """`cast` of an op's three inputs (x, weight, bias) as one autograd node, not three (each node costs ~12 us a
    step on CPU), around an op with a backward of its own (a tensor-core GEMM, a convolution torch pads itself):
    `_rounded_inputs` forward, `_rounded_gradients` backward. A gradient nobody needs is not made. Under autocast
    (`widen`) autograd hands x's gradient back in x's dtype, as the widening cast's own node did."""

    @staticmethod
    def forward(ctx, casts: "OpCasts", widen: bool, x, weight, bias):
        ctx.casts = casts
        ctx.set_materialize_grads(False)
        outputs = _rounded_inputs(casts, widen, x, weight, bias)
        # an output whose input wants no gradient wants none either (autograd would otherwise mark every output, and
        # the op would compute a gradient nobody reads: the input batch's, through the first convolution)
        ctx.mark_non_differentiable(*(t for t, wanted in zip(outputs, ctx.needs_input_grad[2:])
                                      if t is not None and not wanted))
        return outputs

    @staticmethod
    def backward(ctx, grad_x, grad_weight, grad_bias):
        return None, None, *_rounded_gradients(ctx.casts, ctx.needs_input_grad[2:], grad_x, grad_weight, grad_bias)


# a Linear's bias gradient, grad.sum(0) by torch's own reduction, also inside a compiled op pass, which calls it as an
# extern kernel: inductor's generated sum adds the rows in another order, and a bias gradient summed over 32 rows of
# FP32 values came out different in about half its elements (tests/test_fused.py). Defined with torch.library's
# Library, its Python kernel costs 1.6 us a call more than the sum; torch.library.custom_op's wrapping cost 8.7 us
# more, 5% of LeNet FP8's step (docs/performance.md)
_OPS = torch.library.Library("precision_bench", "DEF")
_OPS.define("summed_rows(Tensor grad) -> Tensor")
_OPS.impl("summed_rows", lambda grad: grad.sum(0), "CompositeExplicitAutograd")
_OPS.impl("summed_rows", lambda grad: grad.new_empty(grad.shape[1:]), "Meta")
summed_rows = torch.ops.precision_bench.summed_rows.default


@dataclass(frozen=True)
class LinearGemm:
    """F.linear, with the backward torch's autograd runs for it (addmm's or mm's: the same formulas and layouts)."""

    def forward(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def backward(self, grad, x, weight, wanted):
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if wanted[0]:  # mm_mat1_backward: a column-major input gets its gradient column-major
            column_major = x_2d.stride(0) == 1 and x_2d.stride(1) == x_2d.shape[0]
            grad_x = (weight.t().mm(grad_2d.t()).t() if column_major else grad_2d.mm(weight)).view(x.shape)
        if wanted[1]:  # mm_mat2_backward of weight.t(), transposed back
            grad_weight = grad_2d.t().mm(x_2d)
        if wanted[2]:  # the broadcast bias: summed to its shape
            grad_bias = summed_rows(grad_2d)
        return grad_x, grad_weight, grad_bias


@dataclass(frozen=True)
class ConvGemm:
    """F.conv2d with zero padding given in numbers, with the backward torch's autograd runs for it
    (aten.convolution_backward, as ConvolutionBackward0 calls it)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def forward(self, x, weight, bias):
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def backward(self, grad, x, weight, wanted):
        return torch.ops.aten.convolution_backward(
            grad, x, weight, [weight.shape[0]] if wanted[2] else None, self.stride, self.padding, self.dilation,
            False, [0] * len(self.stride), self.groups, list(wanted))


def _op_forward(x, weight, bias, gemm, casts: "OpCasts", dtype, widen: bool = False) -> tuple:
    """`_EmulatedOp`'s forward on its inputs (with `widen`, a 16-bit one widened first): `_rounded_inputs`, the op on
    them, its result rounded. Returns that result, handed on in `dtype` where given (its values in an FP32 tensor
    where the op `carries_out`), and the rounded x and weight that the backward reads."""
    x_r, w_r, b_r = _rounded_inputs(casts, widen, x, weight, bias)
    y = gemm.forward(x_r, w_r, b_r)
    y = y if casts.output is None else casts.output(y)
    if dtype is None:
        return y, x_r, w_r
    if casts.carries_out:
        return rounded_through(y, dtype), x_r, w_r
    return y.to(dtype), x_r, w_r


def _op_backward(grad, x_r, w_r, gemm, casts: "OpCasts", wanted: tuple[bool, bool, bool],
                 dtypes: tuple, carried: torch.dtype | None) -> tuple:
    """`_EmulatedOp`'s backward on its result's gradient, widened back to the op's dtype (x_r's: the dtype its result
    had before it was handed on), rounded, the op's backward on it, `_rounded_gradients`, each handed back in its
    input's dtype (`dtypes`: x's, weight's, bias's), as autograd would hand it back. `carried`: the 16-bit dtype
    whose values the op's result stood for in an FP32 tensor where it `carries_out` (None: autocast was off), to
    which autograd would have rounded that tensor's gradient: here. (The input's gradient, handed back in FP32 to the
    op before, is rounded there, at its entry.)"""
    grad = grad.to(x_r.dtype)
    if carried is not None and casts.carries_out:
        grad = rounded_through(grad, carried)
    grad = grad if casts.grad_output is None else casts.grad_output(grad)
    grads = _rounded_gradients(casts, wanted, *gemm.backward(grad, x_r, w_r, wanted))
    return tuple([g if g is None else g.to(dtype) for g, dtype in zip(grads, dtypes)])


class _EmulatedOp(torch.autograd.Function):
    """An emulated Linear or convolution accumulated exactly in FP32, as one autograd node where it was three (the input
    casts, torch's op, the output cast: a node costs 10-30 us a step here). Forward: `_op_forward` on the inputs
    (widened first under autocast, inside the pass: its graph reads BF16 where an eager cast wrote and the graph
    read FP32, 4% of BERT-tiny's FP8 step on an Intel Xeon, docs/performance.md), autocast off. Backward:
    `_op_backward` on the output's gradient, widened back inside it too (the op's backward as torch's autograd
    computes it: the same kernels on the same layouts, bit for bit, tests/test_precision.py). The op saves its
    rounded operands, as torch's op did (bench/numerics/memory.py counts them). Where its sites round x by x alone
    (OpCasts.run) and fused quantisers run (the CPU), each pass runs as one compiled graph (`fused.Passes`: the
    roundings, the op and the casts in one call, bit for bit the eager pass, tests/test_fused.py), which saves the
    Python and dispatch of three or four calls a pass: 1-3% of LeNet's and BERT-tiny's FP8 steps here
    (docs/performance.md)."""

    @staticmethod
    def forward(ctx, gemm, casts: "OpCasts", widen: bool, dtype, x, weight, bias):
        ctx.input_dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        y, x_r, w_r = casts.run(_op_forward, ("forward", dtype, widen), x, weight, bias, gemm, casts, dtype, widen)
        ctx.gemm, ctx.casts, ctx.carried = gemm, casts, dtype
        ctx.save_for_backward(x_r, w_r)
        return y

    @staticmethod
    def backward(ctx, grad):
        casts, wanted = ctx.casts, tuple(ctx.needs_input_grad[4:])
        x_r, w_r = ctx.saved_tensors
        device = grad.device.type  # a backward run under autocast would otherwise compute its GEMMs in 16 bits
        with torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext(), \
                torch._C.DisableTorchFunction():
            grads = casts.run(_op_backward, ("backward", wanted, ctx.input_dtypes, ctx.carried), grad, x_r, w_r,
                              ctx.gemm, casts, wanted, ctx.input_dtypes, ctx.carried)
        return None, None, None, None, *grads


class OpCasts:
    """The rounding sites of one emulated matmul/conv under a recipe."""

    def __init__(self, recipe: Recipe, site):
        """One site per tensor stream, so that a delayed per-tensor scale keeps each stream's own amax history."""
        sixteen = recipe.sixteen_bit_kernel

        def returned_gradient():  # a 16-bit kernel writes the gradients it returns in 16 bits
            return site("gradients", recipe.inputs) if sixteen else None

        self.activation, self.grad_activation = site("activations", recipe.inputs), returned_gradient()
        self.weight, self.grad_weight = site("weights", recipe.inputs), returned_gradient()
        self.bias = site("weights", recipe.inputs) if sixteen else None
        self.grad_bias = returned_gradient()
        self.grad_output = site("gradients", recipe.grads)
        self.output = site("activations", recipe.inputs) if sixteen else None
        sites = [s for s in (self.activation, self.grad_activation, self.weight, self.grad_weight, self.bias,
                             self.grad_bias, self.grad_output, self.output) if s is not None]
        # the site that speaks for all (`run_pass`: its telemetry, its listener) where each rounds x by x alone (None:
        # they do not): sites that round to nearest, unscaled, and share one telemetry and one listener (one
        # Precision's)
        first = sites[0] if sites else None
        self.compiles_with = first if sites and all(
            s.rounding == "nearest" and s.scaler is None and s.telemetry is first.telemetry
            and s.listener is first.listener for s in sites) else None
        self.passes = Passes()  # this op's forward and backward passes, compiled
        # under autocast, whether the op hands its 16-bit result on as its values in an FP32 tensor (`carried_ops`):
        # set by the precision policy, where what takes that tensor is exact on it and the next such op
        self.carries_out = False

    def run(self, body: Callable, key: tuple, x, *args):
        """body(x, *args), a pass of this op (`_op_forward`, `_op_backward`), as `run_pass` runs it where its sites
        round x by x alone (`compiles_with`), as itself otherwise."""
        if self.compiles_with is None:
            return body(x, *args)
        return run_pass(self.passes, (self.compiles_with,), key, body, x, *args)

    def inputs(self, x, weight, bias, widen: bool = False):
        return _InputCasts.apply(self, widen, x, weight, bias)

    def result(self, y, dtype: torch.dtype | None = None):
        return cast(y, self.output, self.grad_output, dtype)


def run_pass(passes: Passes, sites: tuple, key: tuple, body: Callable, x, *args):
    """body(x, *args), a pass of emulated ops whose rounding sites (each op's `OpCasts.compiles_with`: to nearest,
    unscaled, so that what they make is a function of x alone) share one telemetry: one compiled graph (`passes`),
    on a step with telemetry sampled too (`QuantTelemetry.counted`: the tensors the sites observe are among the
    graph's outputs, counted after the call); eagerly where a memory count listens (it is told of each tensor as it
    is made), and on a sampled step inside a compiled model's step, whose tracer takes the sites' observations as
    they come (its graph breaks there: docs/performance.md)."""
    if any(site.listened() for site in sites):
        return body(x, *args)
    telemetry = sites[0].telemetry
    if telemetry.sampling:
        return body(x, *args) if in_graph() else telemetry.counted(passes.run, key, body, x, *args)
    return passes.run(key, body, x, *args)


def _operand(value: torch.Tensor, site: TensorSite) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a site made (value = its codes / its scale), as the codes a tensor core reads and the scale its GEMM
    divides out after: value * scale is the codes within two FP32 (or, under BF16 autocast, BF16) roundings, far
    inside half a step of the element format, so rounding it again gives them back exactly. The codes, which the
    GEMM saves, are told to the memory accounting as the site's output (held in its format)."""
    scale = site.last_scale
    if scale is None:
        return value, None
    codes = quantise_value(value.float() * scale, site.spec, site.overflow, site.ftz)
    listening = None if site.listener is None else site.listener()
    if listening is not None:
        listening(value, codes, site.tensor_class, site.spec.name)
    return codes, scale


def _descaled(y: torch.Tensor, *scales: torch.Tensor | None) -> torch.Tensor:
    """A scaled GEMM's FP32 result times its operands' inverse scales (torch._scaled_mm's scale_a * scale_b, taken
    as one FP32 factor: an assumption about cuBLAS's epilogue)."""
    factor = None
    for scale in scales:
        if scale is not None:
            factor = scale.reciprocal() if factor is None else factor * scale.reciprocal()
    return y if factor is None else y * factor


def _output_gemm(x_2d, x_scale, w_codes, w_scale, casts: OpCasts, accumulation: Accumulation) -> torch.Tensor:
    """The forward GEMM, x W^T on the codes (tokens x in_features, out x in), descaled."""
    y = matmul(x_2d, w_codes, gpu=accumulation.gpu, a_format=casts.activation.spec.name,
               b_format=casts.weight.spec.name, promote_every=accumulation.promotion(0))
    return _descaled(y, x_scale, w_scale)


def _gradient_gemms(grad_2d, x_2d, x_scale, w_codes, w_scale, casts: OpCasts,
                    accumulation: Accumulation) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward GEMMs on the output gradient's codes, descaled: grad_input = grad W reduces over out_features;
    grad_weight = grad^T x over the tokens."""
    g_codes, g_scale = _operand(grad_2d, casts.grad_output)
    g_format = casts.grad_output.spec.name
    grad_x = matmul(g_codes, w_codes.t(), gpu=accumulation.gpu, a_format=g_format,
                    b_format=casts.weight.spec.name, promote_every=accumulation.promotion(1))
    grad_w = matmul(g_codes.t(), x_2d.t(), gpu=accumulation.gpu, a_format=g_format,
                    b_format=casts.activation.spec.name, promote_every=accumulation.promotion(2))
    return _descaled(grad_x, g_scale, w_scale), _descaled(grad_w, g_scale, x_scale)


class _TensorCoreLinear(torch.autograd.Function):
    """y = x W^T + b with each of its three GEMMs accumulated as a GPU's tensor cores do
    (bench.numerics.tensor_cores.matmul) on the codes its rounding sites made, each scaled GEMM's result divided by
    its operands' scales after, as torch._scaled_mm does; the bias added in FP32 after the GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, casts: OpCasts, accumulation: Accumulation):
        (x_codes, x_scale), (w_codes, w_scale) = _operand(x, casts.activation), _operand(weight, casts.weight)
        ctx.save_for_backward(x_codes, w_codes, x_scale, w_scale)
        ctx.casts, ctx.accumulation, ctx.has_bias = casts, accumulation, bias is not None
        y = _output_gemm(x_codes.reshape(-1, x.shape[-1]), x_scale, w_codes, w_scale, casts, accumulation)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        x_codes, w_codes, x_scale, w_scale = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_x, grad_w = _gradient_gemms(grad_2d, x_codes.reshape(-1, x_codes.shape[-1]), x_scale, w_codes, w_scale,
                                         ctx.casts, ctx.accumulation)
        return grad_x.reshape(x_codes.shape), grad_w, grad_2d.sum(0) if ctx.has_bias else None, None, None


class _TensorCoreConv(torch.autograd.Function):
    """A convolution as an implicit GEMM through the tensor-core model (_TensorCoreLinear's three GEMMs): each output
    position's patch (channels x kernel, im2col's order: K as cuDNN orders it is not known) against the flattened
    weight. It saves the input's codes, as an implicit GEMM does, not its patches (kernel-area times larger), and
    unfolds them again in the backward pass; the input gradient sums the overlapping patches' gradients in FP32
    (F.fold, as autograd folds F.unfold's), where cuDNN runs a GEMM over out channels x kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, casts: OpCasts, accumulation: Accumulation, geometry: dict):
        (x_codes, x_scale), (w_codes, w_scale) = _operand(x, casts.activation), _operand(weight, casts.weight)
        ctx.save_for_backward(x_codes, w_codes, x_scale, w_scale)
        ctx.casts, ctx.accumulation, ctx.has_bias, ctx.geometry = casts, accumulation, bias is not None, geometry
        n, _, height, width = x.shape
        patches = F.unfold(x_codes, **geometry).transpose(1, 2)  # (n, positions, channels x kernel)
        y = _output_gemm(patches.reshape(-1, patches.shape[-1]), x_scale, w_codes.reshape(w_codes.shape[0], -1),
                         w_scale, casts, accumulation).reshape(n, patches.shape[1], -1)
        y = y if bias is None else y + bias
        rows, cols = ((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, p, d, k, s in
                      zip((height, width), geometry["padding"], geometry["dilation"], geometry["kernel_size"],
                          geometry["stride"]))
        return y.transpose(1, 2).reshape(n, -1, rows, cols)

    @staticmethod
    def backward(ctx, grad):
        x_codes, w_codes, x_scale, w_scale = ctx.saved_tensors
        n, out_channels = grad.shape[:2]
        grad_2d = grad.reshape(n, out_channels, -1).transpose(1, 2).reshape(-1, out_channels)
        patches = F.unfold(x_codes, **ctx.geometry).transpose(1, 2)
        positions, patch = patches.shape[1:]
        grad_patches, grad_w = _gradient_gemms(grad_2d, patches.reshape(-1, patch), x_scale,
                                               w_codes.reshape(out_channels, -1), w_scale, ctx.casts, ctx.accumulation)
        grad_x = F.fold(grad_patches.reshape(n, positions, patch).transpose(1, 2), x_codes.shape[-2:], **ctx.geometry)
        return grad_x, grad_w.reshape(w_codes.shape), grad_2d.sum(0) if ctx.has_bias else None, None, None, None


def _outside_autocast(device: str, call: Callable):
    """call(widen, dtype) as an emulated GEMM runs: as it is (False, None) outside autocast; under autocast
    (format.elsewhere=bf16) with autocast and torch-function modes off (bench/numerics/autocast.py's would take each
    of the emulation's own torch calls), told to widen its 16-bit inputs and to hand its result on in autocast's
    dtype. (The carried attention's FP32 math path runs so too, bench/numerics/carried_attention.py.)"""
    if not torch.is_autocast_enabled(device):
        return call(False, None)
    dtype = torch.get_autocast_dtype(device)
    # what `torch.autocast(device, enabled=False)` does inside an autocast that is on (its nesting count and cache
    # matter only where it is the outermost), without its 3 us of Python a call (hot; five calls a LeNet step)
    torch.set_autocast_enabled(device, False)
    try:
        with torch._C.DisableTorchFunction():
            return call(True, dtype)
    finally:
        torch.set_autocast_enabled(device, True)


def emulated_gemm(function, *tensors, rounded=None, result=None):
    """`function` (a linear, a conv or a blocked GEMM) on its emulated operands (`rounded` makes them; OpCasts.inputs)
    in FP32, autocast off: the operands hold the format's values, and an autocast GEMM would round them again
    (NVFP4's tensor scale does not fit BF16). Under autocast (format.elsewhere=bf16) BF16 inputs are widened before
    they are rounded, which is exact, so the operands the GEMM saves are the rounded ones (bench/numerics/memory.py
    counts those), and the result is handed on in the autocast dtype, as an FP8 GEMM writes it; otherwise as
    computed. `result` (OpCasts.result) takes the FP32 result and that dtype: its gradient comes back widened and is
    rounded in FP32, where the BF16 gradient would take two passes more (the same values)."""
    def call(widen: bool, dtype: torch.dtype | None):
        y = function(*(rounded(*tensors, widen=widen) if rounded is not None else
                       _widened(*tensors) if widen else tensors))
        if result is not None:
            return result(y, dtype)
        return y if dtype is None else y.to(dtype)

    return _outside_autocast(next(t for t in tensors if t is not None).device.type, call)


def emulated_op(gemm: LinearGemm | ConvGemm, casts: "OpCasts", x, weight, bias):
    """`emulated_gemm` of an op accumulated exactly, as one `_EmulatedOp` node (which widens, rounds and narrows
    itself)."""
    return _outside_autocast(x.device.type, lambda widen, dtype: _EmulatedOp.apply(gemm, casts, widen, dtype, x,
                                                                                   weight, bias))


LINEAR = LinearGemm()


class CastOp:
    """Mixin for a matmul/conv module whose inputs, output and gradients an emulated precision rounds.

    `casts` is None (nothing rounded) until `Precision.prepare` gives the module its sites; a block format gives a
    Linear its GEMM `operands` instead (unit scaling's Linear, whose scales sit around the GEMM).
    """

    casts: OpCasts | None = None
    operands: BlockOperands | FP8TileOperands | None = None
    accumulation: Accumulation | None = None  # a GPU's tensor cores (format.accumulation); None: exact FP32

    def linear(self, x, weight, bias):
        """F.linear as the precision computes it: on block-scaled GEMM operands, or on rounded inputs and output,
        accumulated exactly or as the run's tensor cores do."""
        if self.operands is not None:
            return emulated_gemm(lambda *t: _BlockLinear.apply(*t, self.operands), x, weight, bias)
        if self.accumulation is not None and self.casts is not None:
            return self.gemm(lambda *t: _TensorCoreLinear.apply(*t, self.casts, self.accumulation), x, weight, bias)
        return self.gemm(F.linear, x, weight, bias, exact=LINEAR)

    def gemm(self, function, x, weight, bias, exact: LinearGemm | ConvGemm | None = None):
        """`function(x, weight, bias)` as the precision computes it: emulated on rounded inputs, its output rounded
        (`exact`, where the op accumulates exactly and has it: as one autograd node); with nothing to round (FP32, or
        a native format), as torch runs it, under the run's autocast if any."""
        if self.casts is None:
            return function(x, weight, bias)
        if exact is not None:
            return emulated_op(exact, self.casts, x, weight, bias)
        return emulated_gemm(function, x, weight, bias, rounded=self.casts.inputs, result=self.casts.result)


class EmulatedLinear(CastOp, nn.Linear):
    def forward(self, x):
        return self.linear(x, self.weight, self.bias)


class EmulatedConv2d(CastOp, nn.Conv2d):
    def forward(self, x):
        if self.accumulation is not None and self.casts is not None:
            return self.gemm(self._tensor_core_conv, x, self.weight, self.bias)
        return self.gemm(self._conv_forward, x, self.weight, self.bias, exact=self.exact_gemm())

    def exact_gemm(self) -> ConvGemm | None:
        """This convolution with the backward torch's autograd runs for it: zero padding given in numbers; None where
        torch pads it itself (a padding mode, or `same`/`valid`)."""
        if isinstance(self.padding, str) or self.padding_mode != "zeros":
            return None
        return ConvGemm(self.stride, self.padding, self.dilation, self.groups)

    def _tensor_core_conv(self, x, weight, bias):
        """The convolution through the tensor-core model, as an implicit GEMM (_TensorCoreConv)."""
        geometry = {"kernel_size": self.kernel_size, "dilation": self.dilation, "padding": self.padding,
                    "stride": self.stride}
        return _TensorCoreConv.apply(x, weight, bias, self.casts, self.accumulation, geometry)

    @property
    def implicit_gemm(self) -> str | None:
        """Why this convolution has no implicit GEMM here (None: it has one)."""
        if self.groups != 1:
            return f"groups={self.groups}"
        if isinstance(self.padding, str) or self.padding_mode != "zeros":
            return f"padding={self.padding!r}, padding_mode={self.padding_mode!r}"
        return None


EMULATED_MODULES = {nn.Linear: EmulatedLinear, nn.Conv2d: EmulatedConv2d}

# Modules that give the same values, forward and backward, on 16-bit values held in FP32 tensors as on the 16-bit
# tensors: they select, move or reshape values and round none. A max-pool's backward adds the gradients of windows
# that overlap, so it is one only where they do not.
_SELECTING = (nn.ReLU, nn.Flatten, nn.Unflatten, nn.Identity)
_POOLS = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}


def _selects(module: nn.Module) -> bool:
    if type(module) in _SELECTING:  # these classes themselves: a subclass may compute something else
        return True
    dims = _POOLS.get(type(module))
    if dims is None:
        return False
    per_dim = lambda value: tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims
    return per_dim(module.stride) == per_dim(module.kernel_size) and per_dim(module.dilation) == (1,) * dims


def _exact_op(module: nn.Module) -> bool:
    """An emulated Linear or convolution that runs as one `_EmulatedOp` (CastOp.gemm's `exact` path: rounded,
    accumulated exactly)."""
    if type(module) not in (EmulatedLinear, EmulatedConv2d) or module.casts is None \
            or module.accumulation is not None or module.operands is not None:
        return False
    return type(module) is EmulatedLinear or module.exact_gemm() is not None


def carried_ops(model: nn.Module) -> list[CastOp]:
    """The emulated ops of `model` that can hand BF16 autocast's values to one another in FP32 tensors, in the order
    its forward runs them; [] where the model is not such a chain.

    Under format.elsewhere=bf16 an emulated op hands its result on in BF16, and the ReLU and max-pool after it run in
    BF16, only for the next emulated op to widen their result to FP32 again (LeNet: 2.6% of an FP8 step here,
    docs/performance.md). Where every module between two emulated ops only selects values (`_SELECTING`, a max-pool
    whose windows do not overlap), the first can hand on BF16's values in an FP32 tensor instead, and round that
    tensor's gradient to BF16 as autograd would have: the same values, forward and backward, and two casts and a
    BF16 kernel fewer at each step between them. Such a chain is a Sequential, its own forward running its
    modules in order (nested Sequentials too), whose modules are those ops and selecting ones alone: what the
    forward computes between the ops is then known, and each op appears once (one used twice would hand on FP32 at
    the end). What comes before the first op and after the last is untouched (the loss still gets BF16)."""
    ops = []

    def chain(module: nn.Module) -> bool:
        if type(module).forward is not nn.Sequential.forward:
            return False
        for child in module.children():
            if _exact_op(child):
                ops.append(child)
            elif not (_selects(child) or chain(child)):
                return False
        return True

    return ops if chain(model) and len(ops) > 1 and len(set(map(id, ops))) == len(ops) else []


def _values(telemetry: QuantTelemetry | None, tensor_class: str, spec: ElementFormat, quantiser: Callable,
            t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The dequantised operand `quantiser(t, *args, **kwargs).values`, a block quantiser's (bench/numerics/blocks.py),
    described to `telemetry` on a sampled step. Other steps ask for the values alone (`quantiser.values`): fused,
    that graph writes nothing the GEMM does not read (bench/numerics/fused.py)."""
    if telemetry is None or not telemetry.sampling:
        return quantiser.values(t, *args, **kwargs)
    blocked = quantiser(t, *args, **kwargs)
    telemetry.observe_blocks(tensor_class, t, blocked, spec)
    return blocked.values


@dataclass(frozen=True)
class BlockOperands:
    """How a block-format GEMM operand is made: recipe, scale mode, rounding of the gradient operands; each one
    made on a telemetry-sampled step is described to `telemetry` (block statistics per tensor class).

    NVIDIA's NVFP4 recipe adds (bench/numerics/blocks.py; each None/False leaves the operand as plain NVFP4 makes it):
    `weight_tiles`, the weight in 16 x 16 tiles, quantised once for the forward and the input-gradient GEMMs;
    `rht`, the signs of the 16 x 16 random Hadamard transform applied to both operands of the weight-gradient GEMM
    along the tokens before they are blocked (their tensor scales from the transformed amax, as Transformer Engine
    takes it), its output rounded to `rht_output` (bf16: Transformer Engine's transform reads and writes BF16);
    `scale_rule`, NVFP4's scale arithmetic, torchao's or Transformer Engine's (te: the transform's input rounded to
    BF16 too, as TE reads it); `sr_bits`, the random bits of a stochastic rounding (None: an FP32 uniform)."""

    recipe: Recipe
    scale_mode: str
    rounding: str
    telemetry: QuantTelemetry | None = field(default=None, compare=False)
    weight_tiles: bool = False
    rht: torch.Tensor | None = field(default=None, compare=False)
    rht_output: str = "fp32"
    scale_rule: str = "torchao"
    sr_bits: int | None = None

    def _blocked(self, t: torch.Tensor, tensor_class: str, element: str, dim: int, rounding: str) -> torch.Tensor:
        # NVFP4: dynamic two-level scaling, this tensor's amax sets its FP32 scale
        if self.recipe.block == "nvfp4" and self.scale_rule == "te":
            return self._observed(t, tensor_class, element, te_nvfp4_quantise, None, dim, rounding,
                                  sr_bits=self.sr_bits)
        if self.recipe.block == "nvfp4":
            return self._observed(t, tensor_class, element, nvfp4_quantise, nvfp4_tensor_scale(t), dim, rounding,
                                  sr_bits=self.sr_bits)
        return self._observed(t, tensor_class, element, mx_quantise, element, self.scale_mode, dim,
                              rounding=rounding)

    def _observed(self, t: torch.Tensor, tensor_class: str, element: str, quantiser, *args, **kwargs) -> torch.Tensor:
        return _values(self.telemetry, tensor_class, FORMATS[element], quantiser, t, *args, **kwargs)

    def forward(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self._blocked(t, "activations", self.recipe.inputs, dim, "nearest")

    def weight(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self._blocked(t, "weights", self.recipe.inputs, dim, "nearest")

    def tiled_weight(self, t: torch.Tensor) -> torch.Tensor:
        """The weight in 16 x 16 NVFP4 tiles under its tensor scale, rounded to nearest: both GEMMs' operand."""
        if self.scale_rule == "te":
            return self._observed(t, "weights", self.recipe.inputs, te_nvfp4_tile_quantise)
        return self._observed(t, "weights", self.recipe.inputs, nvfp4_tile_quantise, nvfp4_tensor_scale(t))

    def gradient(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self._blocked(t, "gradients", self.recipe.grads, dim, self.rounding)

    def weight_gradient_operands(self, grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight-gradient GEMM's operands (tokens, out) and (tokens, in), blocked along the tokens: transformed
        first where the recipe has the RHT (both alike, zero-padded to whole groups of 16 tokens: exact)."""
        if self.rht is not None:
            if self.scale_rule == "te":  # TE's transform reads BF16 (and refuses anything else)
                grad, x = (quantise_value(t, "bf16") for t in (grad, x))
            grad, x = (random_hadamard_transform(t, self.rht, 0) for t in (grad, x))
            if self.rht_output != "fp32":
                grad, x = (quantise_value(t, self.rht_output) for t in (grad, x))
        return self.gradient(grad, 0), self.forward(x, 0)


@dataclass(frozen=True)
class FP8TileOperands:
    """FP8 GEMM operands with finer scales than one per tensor (scaling=rowwise | rowwise_with_gw_hp | block),
    E4M3 throughout: rowwise, one torchao scale per row along the reduced dimension; block, Transformer Engine's
    1 x 128 tiles along it for activations and gradients and 128 x 128 tiles for weights (bench/numerics/blocks.py).

    rowwise_with_gw_hp is torchao's recipe of that name: the output and input-gradient GEMMs as rowwise but for
    the weight, which the input-gradient GEMM takes with one scale for the whole tensor, and the weight-gradient
    GEMM in high precision. _BlockLinear names each GEMM by the dimension its operands are reduced along: dim 0
    of an activation or a gradient is the weight-gradient GEMM's, dim 0 of the weight the input-gradient GEMM's."""

    tiles: TileScaling
    rounding: str = "nearest"  # of the gradient operands
    telemetry: QuantTelemetry | None = field(default=None, compare=False)

    def _observed(self, t: torch.Tensor, tensor_class: str, quantiser, *args, **kwargs) -> torch.Tensor:
        return _values(self.telemetry, tensor_class, FORMATS["fp8_e4m3"], quantiser, t, *args, **kwargs)

    @property
    def rowwise(self) -> bool:
        return self.tiles.rows

    @property
    def grad_weight_in_high_precision(self) -> bool:
        return self.tiles.grad_weight_in_high_precision

    @property
    def weight_tiles(self) -> bool:
        """Block scaling's 128 x 128 weight tiles are the same bits for the forward and the input-gradient GEMM
        (W and W^T): quantised once per step, as Transformer Engine keeps one quantised weight for both. Rowwise
        scales run along each GEMM's own reduction, so its weight is quantised per GEMM."""
        return not self.rowwise

    def tiled_weight(self, t: torch.Tensor) -> torch.Tensor:
        return self._observed(t, "weights", tile2d_quantise)

    def _runs(self, t: torch.Tensor, tensor_class: str, dim: int, rounding: str = "nearest") -> torch.Tensor:
        return self._observed(t, tensor_class, rowwise_quantise if self.rowwise else tile_quantise, dim,
                              rounding=rounding)

    def forward(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if dim == 0 and self.grad_weight_in_high_precision:
            return t
        return self._runs(t, "activations", dim)

    def weight(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if dim == 0 and self.grad_weight_in_high_precision:  # one power-of-two scale for the whole weight
            flat = t.reshape(1, -1)
            return self._observed(flat, "weights", rowwise_quantise, -1).reshape(t.shape)
        return self._runs(t, "weights", dim)  # rowwise (block scaling's weight: tiled_weight)

    def gradient(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if dim == 0 and self.grad_weight_in_high_precision:
            return t
        return self._runs(t, "gradients", dim, self.rounding)

    def weight_gradient_operands(self, grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gradient(grad, 0), self.forward(x, 0)


class _BlockLinear(torch.autograd.Function):
    """y = x W^T + b with every GEMM operand blocked along that GEMM's reduction dimension: in torchao's NVFP4
    tracker's layouts, 1 x 16 for the activations and the output gradient, 16 x 1 (along the tokens) for both
    operands of the weight-gradient GEMM, and the weight in 1 x 16 blocks per GEMM or in 16 x 16 tiles once."""

    @staticmethod
    def forward(ctx, x, weight, bias, operands: BlockOperands):
        ctx.save_for_backward(x, weight)
        ctx.operands, ctx.has_bias = operands, bias is not None
        # as torchao computes it: a 2-D matmul, then the bias (a fused addmm can differ in the last bit)
        if operands.weight_tiles:  # one quantised weight serves the input-gradient GEMM too
            ctx.tiled_weight = blocked_weight = operands.tiled_weight(weight)
        else:
            blocked_weight = operands.weight(weight, -1)
        y = (operands.forward(x, -1).reshape(-1, x.shape[-1]) @ blocked_weight.t()).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        operands = ctx.operands
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        # grad_input = grad @ W reduces over out_features; grad_weight = grad^T @ x reduces over the tokens
        blocked_weight = ctx.tiled_weight if operands.weight_tiles else operands.weight(weight, 0)
        grad_x = (operands.gradient(grad_2d, -1) @ blocked_weight).reshape(x.shape)
        grad_operand, x_operand = operands.weight_gradient_operands(grad_2d, x_2d)
        grad_weight = grad_operand.t() @ x_operand
        return grad_x, grad_weight, grad_2d.sum(0) if ctx.has_bias else None, None
