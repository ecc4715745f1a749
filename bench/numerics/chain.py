"""An emulated chain as one autograd node: a model that is a Sequential of emulated ops and of the modules that only
select values between them (LeNet-5: convolutions, Linears, ReLUs, max-pools, a Flatten) runs its forward as one
pass and its backward as one pass, each one compiled graph where fused code runs (bench/numerics/fused.py), bit for
bit what its modules compute one by one.

Why: each emulated op costs Python that FP32's op does not: its module call, its autograd Function's apply and
context, its pass's lookups (bench/numerics/emulation.py's _EmulatedOp). About 20 us hot a pass, and more inside a
step, where the code has gone cold: LeNet FP8's step was 1.31 x FP32's here with its modules one by one, and 1.17 x
as one node, in the same alternating rounds (docs/performance.md). The modules between the ops (ReLU, max-pool,
Flatten) are nodes of their own too, which the chain's one node also spares.

What it computes: the modules' own calls, in their order. Each op is `emulation._op_forward` and `_op_backward`,
as its `_EmulatedOp` runs them. A ReLU is torch.relu forward and aten's threshold_backward backward, a max-pool aten's
max_pool2d_with_indices and its backward, as autograd runs them for nn.ReLU and nn.MaxPool2d. A reshaping module
(Flatten, Unflatten, Identity) reshapes forward, and the gradient takes the shape of what it reaches backward.
The node saves what those nodes saved: each op's rounded operands, each ReLU's result, each max-pool's input and
indices. Inside a fused graph inductor computes the ReLU and the max-pool itself: exact selections (one gradient
reaches each element of a pool whose windows do not overlap), tested against the modules, bit for bit, NaN, ties
and a negative zero included (tests/test_chain.py).

When it runs: `Precision.prepare` puts an `EmulatedChain` in the place of a model that is such a chain
(`emulation.carried_ops`, its pools 2-D), and a call runs the chain as one node when all of these hold, and the
modules one by one (the model's own forward) otherwise:
- no graph is being traced (a compiled model's step: its tracer takes the modules one by one);
- every op's rounding sites round x by x alone (`OpCasts.compiles_with`: no scale, no draws) and share one
  telemetry, and no memory count is listening (it counts what each module saves as it saves it). On a step with
  telemetry sampled the chain runs as one node, its passes compiled, as each op runs its passes on such a step
  (`emulation.run_pass`: what the sites observe is counted after each graph), the counts of the passes run eagerly;
- no module of the chain has hooks, and none are global;
- autocast is off, or on with each op but the last handing its values on in FP32 (`OpCasts.carries_out`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from bench.numerics.emulation import (
    LINEAR,
    CastOp,
    ConvGemm,
    LinearGemm,
    OpCasts,
    _op_backward,
    _op_forward,
    _outside_autocast,
    carried_ops,
    run_pass,
)
from bench.numerics.formats import rounded_through
from bench.numerics.fused import Passes, in_graph
from bench.numerics.swap import with_state_of

aten = torch.ops.aten


@dataclass(frozen=True)
class _Op:
    """An emulated Linear or convolution: saves its rounded x and weight."""

    module: CastOp
    gemm: LinearGemm | ConvGemm
    casts: OpCasts  # the module's when the plan was made (a graph takes its sites in as constants)
    saves = 2

    def forward(self, h, params, dtype):
        h, x_r, w_r = _op_forward(h, params[0], params[1], self.gemm, self.casts, dtype)
        return h, (x_r, w_r)

    def output_shape(self, x_r: torch.Tensor, w_r: torch.Tensor) -> tuple:
        """What the op's forward gave, from its rounded operands (a gradient reaching it through a reshape)."""
        if isinstance(self.gemm, LinearGemm):
            return (*x_r.shape[:-1], w_r.shape[0])
        g = self.gemm
        spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in
                   zip(x_r.shape[2:], w_r.shape[2:], g.stride, g.padding, g.dilation)]
        return (x_r.shape[0], w_r.shape[0], *spatial)

    def backward(self, grad, saved, wanted, dtypes):
        """The op's backward on its result's gradient, which the chain has already rounded to the 16-bit dtype
        that the result stood for (`_Plan.backward_pass`): `_op_backward` is not asked to round it again."""
        x_r, w_r = saved
        grad = grad.reshape(self.output_shape(x_r, w_r))
        return _op_backward(grad, x_r, w_r, self.gemm, self.casts, wanted, dtypes, None)


@dataclass(frozen=True)
class _Relu:
    """nn.ReLU: saves its result, as ReluBackward0 does."""

    saves = 1

    def forward(self, h):
        h = torch.relu(h)
        return h, (h,)

    def backward(self, grad, saved):
        out, = saved
        return aten.threshold_backward(grad.reshape(out.shape), out, 0)


@dataclass(frozen=True)
class _MaxPool:
    """nn.MaxPool2d: saves its input and indices, as MaxPool2DWithIndicesBackward0 does."""

    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    ceil_mode: bool
    saves = 2

    def forward(self, h):
        out, indices = aten.max_pool2d_with_indices(h, self.kernel, self.stride, self.padding, self.dilation,
                                                    self.ceil_mode)
        return out, (h, indices)

    def backward(self, grad, saved):
        h, indices = saved
        return aten.max_pool2d_with_indices_backward(grad.reshape(indices.shape), h, self.kernel, self.stride,
                                                     self.padding, self.dilation, self.ceil_mode, indices)


@dataclass(frozen=True)
class _Reshape:
    """nn.Flatten, nn.Unflatten, nn.Identity: saves nothing; backward, the step before it reshapes the gradient to
    its own result's shape."""

    module: nn.Module
    saves = 0

    def forward(self, h):
        return self.module(h), ()

    def backward(self, grad, saved):
        return grad


def _pair(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def _step(module: nn.Module):
    """The chain's step for one of its modules; None where the chain does not run it (a 1-D or 3-D max-pool)."""
    if isinstance(module, CastOp):
        return _Op(module, LINEAR if isinstance(module, nn.Linear) else module.exact_gemm(), module.casts)
    if type(module) is nn.ReLU:
        return _Relu()
    if type(module) is nn.MaxPool2d:
        return _MaxPool(_pair(module.kernel_size), _pair(module.stride), _pair(module.padding),
                        _pair(module.dilation), module.ceil_mode)
    if type(module) in (nn.Flatten, nn.Unflatten, nn.Identity):
        return _Reshape(module)
    return None


def _chain_steps(modules: list[nn.Module]) -> tuple | None:
    """The steps of these modules (a chain's leaves, in order) where they run as one node: a chain that
    `emulation.carried_ops` accepts, every module a step, every op's sites rounding x by x alone
    (`OpCasts.compiles_with`: no scale, no draws) and sharing one telemetry; None otherwise."""
    if not carried_ops(nn.Sequential(*modules)):  # first: `_step` takes an emulated module for an exact op
        return None
    steps = tuple(map(_step, modules))
    if None in steps:
        return None
    sites = [step.casts.compiles_with for step in steps if isinstance(step, _Op)]
    return steps if None not in sites and all(site.telemetry is sites[0].telemetry for site in sites) else None


def _state(module: nn.Module) -> tuple:
    """What a plan takes of a module: the module, its class, and an op's rounding sites, tensor-core model and block
    operands (read from its __dict__: nn.Module's __getattr__ costs microseconds a miss, and this is asked every
    call)."""
    attributes = module.__dict__
    return module, type(module), attributes.get("casts"), attributes.get("accumulation"), attributes.get("operands")


def _leaves(sequential: nn.Module) -> list[nn.Module]:
    """The chain's modules in the order its forward calls them (nested Sequentials opened; `_modules` read directly,
    as Sequential.forward reads it, without `children()`'s bookkeeping)."""
    leaves = []
    for child in sequential._modules.values():
        if isinstance(child, nn.Sequential) and type(child).forward is nn.Sequential.forward:
            leaves += _leaves(child)
        elif child is not None:
            leaves.append(child)
    return leaves


class _Plan:
    """The steps of one chain of modules, and its two passes compiled (one `Passes`)."""

    def __init__(self, state: tuple, steps: tuple):
        self.state, self.steps = state, steps
        self.modules = [module for module, *_ in state]
        self.ops = [step for step in steps if isinstance(step, _Op)]
        self._parameters = [op.module._parameters for op in self.ops]
        self.sites = [step.casts.compiles_with for step in self.ops]
        self.passes = Passes()

    def params(self) -> list[torch.Tensor]:
        """Each op's weight and bias (None where it has none), in the order of its steps: read at each call, from
        the modules' parameter dicts (where a module keeps them, and where FSDP puts the gathered ones)."""
        return [t for parameters in self._parameters for t in (parameters["weight"], parameters["bias"])]

    def listened(self) -> bool:
        """Whether a memory count listens to the sites now (bench/numerics/memory.py)."""
        return any(site.listened() for site in self.sites)

    def run(self, key: tuple, body: Callable, x: torch.Tensor, *args):
        """A pass of the chain as `emulation.run_pass` runs an op's (OpCasts.run)."""
        return run_pass(self.passes, self.sites, key, body, x, *args)

    def forward_pass(self, x, dtype, *params):
        """The modules' forward on x: (the result, then everything the steps save, in their order)."""
        saved, h, at = [], x, 0
        for step in self.steps:
            if isinstance(step, _Op):
                h, kept = step.forward(h, params[at:at + 2], dtype)
                at += 2
            else:
                h, kept = step.forward(h)
            saved += kept
        return (h, *saved)

    def backward_pass(self, grad, dtype, wanted: tuple, dtypes: tuple, *saved):
        """The modules' backward on the result's gradient: (x's gradient, then each op's weight's and bias's, None
        where nobody wants it). wanted, dtypes: per op, as `_EmulatedOp` has them (x, weight, bias).

        Under autocast (`dtype`, 16-bit) each op but the first hands its input's gradient back rounded to `dtype`,
        as autograd hands a gradient back to a 16-bit input: before the selections between it and the op before,
        which are exact on it, so that op receives the values `_EmulatedOp` would round at its entry. Rounded there,
        it is not fused with the op before's FP8 rounding, which inductor's CPU code would run in one kernel with it
        at twice the vector width: on AVX-512, LeNet's ReLU and max-pool backward with both roundings took 242 us a
        call against 112 (docs/performance.md).
        """
        grads, end, at = [], len(saved), len(self.ops)
        for step in reversed(self.steps):
            kept = saved[end - step.saves:end]
            end -= step.saves
            if isinstance(step, _Op):
                at -= 1
                grad, grad_weight, grad_bias = step.backward(grad, kept, wanted[at], dtypes[at])
                grads[:0] = [grad_weight, grad_bias]
                if not wanted[at][0]:  # nothing before this op wants a gradient (autograd would have no node there)
                    return (None, *[None] * 2 * at, *grads)
                if dtype is not None and at > 0:  # an FP32 tensor that carried the op before's 16-bit values
                    grad = rounded_through(grad, dtype)
            else:
                grad = step.backward(grad, kept)
        return (grad, *grads)


class _Chain(torch.autograd.Function):
    """The chain's modules as one autograd node (autocast off inside: the ops widen and hand on themselves)."""

    @staticmethod
    def forward(ctx, plan: _Plan, dtype, x, *params):
        ctx.plan, ctx.dtype, ctx.x_dtype = plan, dtype, x.dtype
        ctx.param_dtypes = tuple(None if p is None else p.dtype for p in params)
        if dtype is not None:  # under autocast a 16-bit x is widened, as _EmulatedOp widens it
            x = x.float()
        y, *saved = plan.run(("forward", dtype), plan.forward_pass, x, dtype, *params)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad):
        plan, need = ctx.plan, ctx.needs_input_grad[3:]
        wanted, dtypes, upstream = [], [], ctx.needs_input_grad[2]
        for i in range(len(plan.ops)):
            weight, bias = need[2 * i], need[2 * i + 1]
            wanted.append((upstream, weight, bias))
            # an op's x: the chain's own at the first op, an FP32 tensor after (an op hands on FP32 in a chain)
            dtypes.append((ctx.x_dtype if i == 0 else torch.float32, *ctx.param_dtypes[2 * i:2 * i + 2]))
            upstream = upstream or weight or bias
        wanted, dtypes = tuple(wanted), tuple(dtypes)
        grad = grad.float()  # the last op's own dtype, as _EmulatedOp widens its result's gradient back
        device = grad.device.type  # a backward run under autocast would otherwise compute its GEMMs in 16 bits
        with torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext(), \
                torch._C.DisableTorchFunction():
            grads = plan.run(("backward", ctx.dtype, wanted, dtypes), plan.backward_pass, grad, ctx.dtype, wanted,
                             dtypes, *ctx.saved_tensors)
        return None, None, *grads


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


class EmulatedChain(nn.Sequential):
    """A Sequential that runs as one autograd node where it can (the module docstring says when), its modules one by
    one otherwise. `chained` makes one in a model's place."""

    _plan: _Plan | None = None

    def forward(self, x):
        if in_graph() or not isinstance(x, torch.Tensor) or (plan := self._plan_now()) is None:
            return super().forward(x)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        if not self._runs(plan, x, dtype):
            return super().forward(x)
        # autocast off around the node, as around an op (the ops widen and hand on themselves)
        return _outside_autocast(device, lambda widen, dtype: _Chain.apply(plan, dtype, x, *plan.params()))

    def _plan_now(self) -> _Plan | None:
        """The plan for the modules the chain holds now, made again where they changed (a module swapped in, an op's
        rounding taken off for evaluation in full precision and put back); None where they are not a chain."""
        state = tuple(map(_state, _leaves(self)))
        if self._plan is None or self._plan.state != state:
            self._plan = _Plan(state, _chain_steps([module for module, *_ in state]) or ())
        return self._plan if self._plan.steps else None

    @staticmethod
    def _runs(plan: _Plan, x: torch.Tensor, dtype: torch.dtype | None) -> bool:
        """Whether this call runs as one node: no memory count listening, no hooks, and autocast off with an FP32 x
        or on with every op but the last handing on FP32."""
        if plan.listened():
            return False
        if any(getattr(module_globals, name) for name in _GLOBAL_HOOKS) or any(
                m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                for m in plan.modules):
            return False
        if dtype is None:
            return x.dtype == torch.float32
        return all(op.casts.carries_out for op in plan.ops[:-1])


_CHAINED: dict[type, type] = {}  # per model class, its EmulatedChain


def chained(model: nn.Module) -> nn.Module:
    """`model` as an EmulatedChain where it is a Sequential, running its own forward, whose modules run as one node
    (`_chain_steps`), `model` itself otherwise. The EmulatedChain holds the model's own modules and parameters
    (swap.with_state_of) and is of a subclass of the model's class (an instance of LeNet5 still, its methods kept),
    named after it: ChainedLeNet5."""
    if type(model).forward is not nn.Sequential.forward or _chain_steps(_leaves(model)) is None:
        return model
    cls = type(model)
    if cls not in _CHAINED:
        _CHAINED[cls] = type(f"Chained{cls.__name__}", (EmulatedChain, cls), {"__module__": __name__})
    return with_state_of(_CHAINED[cls], model)
