"""One training step of a cell's own model, traced op by op: what the speed model (bench/speed/model.py) predicts
a GPU's step time from, and the FLOPs a record's TFLOP/s divides.

The step is the cell's task as the runner builds it (its model with the scaling method's transform applied, one
training batch, the task's loss, the optimiser the config names), run once on the meta device, where no value is
computed and no memory is used, so the 110M-parameter BERT-base or an 8B-parameter Llama traces in seconds on a
laptop. A TorchDispatchMode sees every aten op of the forward pass, the backward pass and the optimiser step, and
records for each: its FLOPs (torch.utils.flop_counter's formulas), the elements it reads and writes per tensor
(with the tensors' identities, so a fusion model can tell which of them stay inside a fused kernel), the module it
ran in (torch.utils.module_tracker) and the kernels it launches eagerly. Views are recorded too (they cost a
dispatch, not a kernel) and alias the tensor they view.

The trace is of the model in FP32 and without the cell's precision: what a format changes (operand bytes, GEMM
rates, casts, autocast's copies) is the speed model's to apply per setting and GPU, since a GPU runs a format
natively where a CPU emulates it. Attention through F.scaled_dot_product_attention is traced as one fused op, as
a GPU runs it (the meta device would otherwise decompose it into its math). A model whose step cannot run on the
meta device (an op without a meta kernel, or one that reads a value) is traced on the CPU instead, at the cost of
computing one real step, and the trace says so (`note`).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from dataclasses import dataclass, field, replace
from unittest import mock

import torch
import torch._dynamo  # noqa: F401 - torch.optim's first optimiser imports it (seconds): at import, not in a trace's time
import yaml
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

from bench.data import DATA_DIR

aten = torch.ops.aten

GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten.convolution_backward, aten._convolution}
ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu,
             aten._scaled_dot_product_flash_attention_for_cpu_backward,
             aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
             aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward}
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class TracedOp:
    """One aten op of the step."""

    op: str  # the overload, e.g. "aten.addmm.default"
    phase: str  # forward | backward | optimizer
    kind: str  # gemm | attention | memory | view
    module: str  # the innermost module it ran in ("" outside the model: the loss, the optimiser)
    module_type: str  # that module's class
    flops: int
    reads: tuple[int, ...]  # elements of each tensor it reads
    writes: tuple[int, ...]  # elements of each tensor it writes
    inputs: tuple[int, ...]  # identities of the tensors it reads (a view's, its base's)
    outputs: tuple[int, ...]  # identities of the tensors it writes
    kernels: int  # kernels it launches when run eagerly (0 for a view)
    sizes: tuple[int, ...] = ()  # bytes per element of each tensor it reads, then writes, as traced (FP32 for floats)
    role: str | None = None  # a Linear's GEMM: output | grad_input | grad_weight
    gemm: tuple[int, int, int, int] | None = None  # a matrix product's (batch, M, K, N); None for a convolution


@dataclass
class StepTrace:
    """The ops of one training step, and what a recipe needs to know of the model's Linear layers."""

    ops: list[TracedOp]
    linears: dict[str, tuple[int, int, int]]  # Linear name -> (tokens, in_features, out_features) of its forward GEMM
    parameters: int  # trainable elements
    traced_on: str  # meta | cpu
    seconds: float
    held: frozenset = frozenset()  # identities of the model's parameters and buffers (not activations)
    note: str | None = None
    module_types: dict[str, str] = field(default_factory=dict)
    gemm_weights: dict[str, int] = field(default_factory=dict)  # Linear/Conv2d name -> its weight's elements
    state_format: str = "fp32"  # model.optimizer.state_format: the optimiser's moments as stored (traced as FP32)
    master_weights: str = "fp32"  # train.master_weights: the parameters as stored (traced as FP32)

    def flops(self, phase: str | None = None) -> int:
        return sum(o.flops for o in self.ops if phase is None or o.phase == phase)


def _multi_output_kernels(func, out) -> int:
    """Kernels an op launches eagerly: one, or one per gradient a fused backward computes (a convolution's input,
    weight and bias gradients), or per list a foreach/fused optimiser kernel walks (in chunks of about 24 tensors)."""
    name = func._overloadpacket.__name__
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if name.startswith(("_foreach_", "_fused_")):
        return max(1, -(-len(tensors) // 24))
    if name == "convolution_backward":
        return max(1, len(tensors))
    return 1


class _SDPAFused(TorchFunctionMode):
    """F.scaled_dot_product_attention as one fused kernel, as a GPU runs it: the CPU flash op (which has meta kernels
    and the same FLOP formulas as CUDA's); grouped-query attention's K and V heads repeated first, attention dropout
    left to the kernel (a GPU's flash kernel drops inside it; the CPU one takes none)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args)) | kwargs
        q, k, v = bound["query"], bound["key"], bound["value"]
        if bound.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            repeat = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
        mask = bound.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=0.0, is_causal=bool(bound.get("is_causal", False)),
            attn_mask=mask, scale=bound.get("scale"))[0]


class _Recorder(TorchDispatchMode):
    """Records each op (TracedOp). Ops belong to the innermost module running (torch.utils.module_tracker), but a
    GEMM of the backward pass belongs to the Linear whose weight it reads (its input gradient) or whose output's
    gradient it reads (its weight gradient): Linears that share an input (attention's q, k and v) run their
    backward GEMMs while each other's backward hooks are active, and the tracker alone cannot tell them apart."""

    def __init__(self, tracker: ModuleTracker, modules: dict[str, nn.Module]):
        super().__init__()
        self.tracker, self.modules = tracker, modules
        self.phase = "forward"
        self.ops: list[TracedOp] = []
        self.alias: dict[int, int] = {}  # a view's identity -> its base's
        self.kept: list[torch.Tensor] = []  # every tensor seen, kept alive so that no identity is reused
        self.owner: dict[int, str] = {id(m.weight): name for name, m in modules.items() if isinstance(m, nn.Linear)}

    def own_output_gradient(self, name: str):
        """A hook for a Linear's output: the gradient it receives belongs to that Linear's backward GEMMs."""
        def hook(gradient: torch.Tensor) -> None:
            self.kept.append(gradient)
            self.owner[self._identity(gradient)] = name
        return hook

    def _identity(self, t: torch.Tensor) -> int:
        return self.alias.get(id(t), id(t))

    def _innermost(self) -> str:
        parents = [p for p in self.tracker.parents if p != "Global"]
        innermost = max(parents, key=lambda p: p.count("."), default="")
        return innermost.split(".", 1)[1] if "." in innermost else ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(func, torch._ops.OpOverload) or func.namespace not in ("aten", "prims"):
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.kept += ins + outs
        packet = func._overloadpacket
        view = func.is_view or packet in (aten.detach, aten.alias, aten.lift_fresh)
        if view:
            for t in outs:
                self.alias[id(t)] = self._identity(ins[0]) if ins else id(t)
        kind = "view" if view else "attention" if packet in ATTENTION else "gemm" if packet in GEMMS else "memory"
        inputs = tuple(self._identity(t) for t in ins)
        module = self._innermost()
        if kind == "gemm" and self.phase == "backward":
            module = next((self.owner[i] for i in inputs if i in self.owner), module)
        owner = self.modules.get(module)
        role = None
        if kind == "gemm" and isinstance(owner, nn.Linear):
            weight = tuple(owner.weight.shape)
            role = "output" if self.phase == "forward" else (
                "grad_weight" if outs and tuple(outs[0].shape) in (weight, weight[::-1]) else "grad_input")
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0
        gemm = _gemm_shape(packet, args) if kind == "gemm" else None
        self.ops.append(TracedOp(
            op=str(func), phase=self.phase, kind=kind, module=module,
            module_type=type(owner).__name__ if owner is not None else "", flops=flops,
            reads=tuple(t.numel() for t in ins), writes=tuple(t.numel() for t in outs), inputs=inputs,
            outputs=tuple(self._identity(t) for t in outs), kernels=0 if view else _multi_output_kernels(func, out),
            role=role, sizes=tuple(t.element_size() for t in (*ins, *outs)), gemm=gemm))
        return out


MATRIX_PRODUCTS = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.bmm: (0, 1), aten.baddbmm: (1, 2)}  # op -> its A and B


def _gemm_shape(packet, args) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a matrix product A (M x K) @ B (K x N), batched or not; None for a convolution."""
    if packet not in MATRIX_PRODUCTS:
        return None
    a, b = (args[i] for i in MATRIX_PRODUCTS[packet])
    batch = a.shape[0] if a.dim() == 3 else 1
    return batch, a.shape[-2], a.shape[-1], b.shape[-1]


@contextlib.contextmanager
def _without_value_reads():
    """transformers reads the attention mask's values to decide whether to pass it to SDPA at all (a batch without
    padding needs none); the meta device has no values: a batch with an attention mask is traced as a padded batch
    is, with the mask, and one without (a masked LM's windows) without. (Only where a model has loaded transformers:
    importing it costs a LeNet cell a second.)"""
    if "transformers" not in sys.modules:
        yield
        return
    from transformers import masking_utils

    unpatched = masking_utils._ignore_bidirectional_mask_sdpa

    def ignored(padding_mask, *args, **kwargs) -> bool:
        return padding_mask is None and unpatched(padding_mask, *args, **kwargs)

    with mock.patch.object(masking_utils, "_ignore_bidirectional_mask_sdpa", ignored):
        yield


_META_KERNELS: list = []  # the library registration below, made once a process


@contextlib.contextmanager
def _fused_optimisers_on_meta():
    """The optimiser as a GPU runs it, fused (build_optimizer's choice on CUDA and CPU): the meta device is not on
    torch's list of fused-kernel devices, though AdamW's fused kernel has a meta implementation; SGD's has none, and
    gets one that does nothing (a kernel's values are never computed on meta)."""
    import torch.optim.optimizer as torch_optimizer

    from bench.tasks import optimizer as model_optimizer

    if not _META_KERNELS:
        library = torch.library.Library("aten", "IMPL")
        library.impl("_fused_sgd_", lambda *args, **kwargs: None, "Meta")
        _META_KERNELS.append(library)
    devices = [*torch_optimizer._get_fused_kernels_supported_devices(), "meta"]
    with mock.patch.object(torch_optimizer, "_get_fused_kernels_supported_devices", lambda: devices), \
            mock.patch.object(model_optimizer, "_get_fused_kernels_supported_devices", lambda: devices):
        yield


@contextlib.contextmanager
def _removed(handles):
    """The hooks `handles` name, removed when the block ends."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _register_cpu_attention_flops() -> None:
    """FlopCounterMode has formulas for SDPA's CUDA kernels but not for the CPU one (torch 2.13), which takes its
    arguments in the same order: the same formulas (the full score matrix, causal or not, as torch counts on CUDA)."""
    for cpu, cuda in ((aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention),
                      (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                       aten._scaled_dot_product_flash_attention_backward)):
        flop_registry.setdefault(cpu, flop_registry[cuda])


def trace_step(task, optimizer_factory, model: nn.Module | None = None, batch=None) -> StepTrace:
    """Trace one training step of `task` with `model` (default: the task's own; meta or CPU) on `batch` (default: the
    task's first training batch): forward and loss, backward, then `optimizer_factory(model)`'s step."""
    _register_cpu_attention_flops()
    model = task.model if model is None else model
    modules = dict(model.named_modules())
    batch = next(iter(task.train_batches(0))) if batch is None else batch
    tracker = ModuleTracker()
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]), _fused_optimisers_on_meta():
        optimizer = optimizer_factory(model)
    recorder = _Recorder(tracker, modules)

    def tag_output(name: str):
        def hook(module, args, out) -> None:  # (returns None: a forward hook's result would replace the output)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(recorder.own_output_gradient(name))
        return hook

    hooks = [m.register_forward_hook(tag_output(name)) for name, m in modules.items() if isinstance(m, nn.Linear)]
    with torch.random.fork_rng(devices=[]), _fused_optimisers_on_meta(), _without_value_reads(), tracker, \
            recorder, _SDPAFused(), _removed(hooks):
        outputs, targets = task.forward(model, batch, lambda x: x)
        loss = task.compute_loss(outputs, targets)
        recorder.phase = "backward"
        loss.backward()
        recorder.phase = "optimizer"
        optimizer.step()
    seconds = time.perf_counter() - start
    linears = {}
    for traced in recorder.ops:
        if traced.role == "output" and traced.module not in linears:
            weight = modules[traced.module].weight
            linears[traced.module] = (traced.writes[0] // weight.shape[0], weight.shape[1], weight.shape[0])
    device = next((p.device.type for p in model.parameters()), "cpu")
    return StepTrace(recorder.ops, linears, sum(p.numel() for p in model.parameters() if p.requires_grad),
                     device, seconds, held=frozenset(id(t) for t in [*model.parameters(), *model.buffers()]),
                     module_types={n: type(m).__name__ for n, m in modules.items()},
                     gemm_weights={n: m.weight.numel() for n, m in modules.items()
                                   if isinstance(m, (nn.Linear, nn.Conv2d))})


def _on_meta(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are on the meta device, made without copying their data (their
    meta twins seed deepcopy's memo, so tied weights stay tied); a parameter's own attributes (u-μP's tags, which
    its optimiser's groups read) go with it."""
    memo = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        twin = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            twin = nn.Parameter(twin, tensor.requires_grad)
            twin.__dict__.update({k: v for k, v in tensor.__dict__.items() if not callable(v)})
        memo[id(tensor)] = twin
    return copy.deepcopy(model, memo)


def trace_task(task, optimizer_factory) -> StepTrace:
    """The runner's trace of a cell's task as built (its scaling method's transform applied, its precision not yet):
    on a meta copy of its model and first batch; on a CPU copy where the meta device cannot run the step.
    `optimizer_factory(model copy)` builds the cell's optimiser over the copy."""
    batch = next(iter(task.train_batches(0)))
    try:
        meta = torch.utils._pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)
        return trace_step(task, optimizer_factory, _on_meta(task.model), meta)
    except (NotImplementedError, RuntimeError) as e:
        traced = trace_step(task, optimizer_factory, copy.deepcopy(task.model), batch)
        traced.note = _cpu_note(e)
        return traced


def stores(trace: StepTrace, cfg) -> None:
    """What the cell stores that its traced step (FP32 parameters and moments) does not show: its state format and
    master weights, for the memory model (bench/speed/model.py step_memory)."""
    trace.state_format = cfg.model.optimizer.get("state_format", "fp32")
    trace.master_weights = cfg.train.get("master_weights", "fp32")


def _cpu_note(error: Exception) -> str:
    """Why the step was traced on the CPU: the error's first sentence (torch's run on; a cut one read as broken)."""
    said = str(error).splitlines()[0].split(". ")[0].rstrip(".")
    return (f"traced on the CPU: the meta device could not run the step ({type(error).__name__}: "
            f"{said if len(said) <= 200 else said[:199] + '…'})")


HUB_ARCHITECTURES = DATA_DIR / "hub_architectures.yaml"


def _stand_in_text(model):
    """A text model's stand-in text where its text (Tiny Shakespeare) is not here (bench.tasks.charlm)."""
    from bench.tasks.charlm import stand_in_text

    return stand_in_text(model.data, 64 * (model.arch.block_size + 1) * max(1, model.batch_size))


def _traceable(cfg):
    """`cfg`, or, for a pretrained model whose checkpoint (or hub data) is not cached here, the same model built at
    the checkpoint's published architecture (HUB_ARCHITECTURES), randomly initialised, on the shipped fixture: the
    same step shapes, no download; for a text model whose text is not here, the same model on stand-in text of its
    vocabulary; and a note saying so."""
    from omegaconf import OmegaConf

    from bench.data import hub

    model = cfg.model
    if model.get("data") is not None and model.data.get("url") and (stand_in := _stand_in_text(model)) is not None:
        cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        cfg.model.data.source, cfg.model.data.path, cfg.model.data.sha256 = "local", str(stand_in), None
        return cfg, ("traced on stand-in text with Tiny Shakespeare's 65 characters: the text is not here, and a "
                     "trace reads no values")
    if not model.get("pretrained", False) or hub.model_cached(model.hub_name):
        return cfg, None
    known = yaml.safe_load(HUB_ARCHITECTURES.read_text())
    if model.hub_name not in known:
        return cfg, None
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.model.pretrained, cfg.model.arch = False, known[model.hub_name]
    if cfg.model.data.source == "hub" and not hub.dataset_cached(cfg.model.data.name):
        cfg.model.data.source = "local"
    return cfg, (f"traced at {model.hub_name}'s published architecture ({HUB_ARCHITECTURES.name}): the checkpoint is "
                 "not cached here")


def trace_cell(cfg, batch=None, full_length: bool = False) -> StepTrace:
    """Trace the cell `cfg` describes as the runner would build it (its task and the scaling method's transform),
    built on the meta device, where no data is read into the model and no value computed; on the CPU where the meta
    device cannot run its step. `batch`: a function (task, device) -> the batch to trace (default: the task's first
    training batch); `full_length`: a text model's batch at full length (bench.tasks.text.full_length_batch)."""
    from bench.numerics.scaling_methods import build as build_scaling_method
    from bench.tasks import build_task
    from bench.tasks.optimizer import build_optimizer, traced_config

    cfg, offline = _traceable(cfg)
    if batch is None and full_length:
        def batch(task, device):
            from bench.tasks.text import full_length_batch

            first = next(iter(task.train_batches(0)), None)
            if first is None:  # the data holds less than one batch: a batch of one is the template
                from omegaconf import OmegaConf

                first = next(iter(build_task(OmegaConf.merge(cfg.model, {"batch_size": 1}), device,
                                             cfg.seed).train_batches(0)))
            if not (isinstance(first, dict) and "input_ids" in first):
                return first
            return full_length_batch(first, cfg.model.batch_size, cfg.model.max_length, task.model.config.vocab_size)

    def traced_on(device: torch.device) -> StepTrace:
        torch.manual_seed(cfg.seed)
        task = build_task(cfg.model, device, cfg.seed)
        method = build_scaling_method(cfg.scaling)
        # the scaling method's model transform, as the runner applies it (its ops are what the GPU runs; a pretrained
        # conversion's check compares real outputs, and its ops are those of a conversion from scratch)
        method.transform(task, pretrained=False, optimizer=None)

        def optimizer(model):
            return build_optimizer(traced_config(cfg.model.optimizer), model.parameters(), task.lr_multipliers,
                                   method.parameter_groups)

        return trace_step(task, optimizer, batch=None if batch is None else batch(task, device))

    try:
        traced = traced_on(torch.device("meta"))
    except (NotImplementedError, RuntimeError) as e:
        traced = traced_on(torch.device("cpu"))
        traced.note = _cpu_note(e)
    stores(traced, cfg)
    unpriced = f"the optimiser step priced by its bytes (state_format={traced.state_format}): torchao's one launch " \
        "per tensor and the quantisation's arithmetic are not in the speed model" if traced.state_format != "fp32" \
        else None
    if offline or unpriced:
        traced.note = "; ".join(filter(None, [offline, traced.note, unpriced]))
    return traced


def with_op_recomputation(trace: StepTrace, blocks: str) -> StepTrace:
    """The step under torchtitan's per-op selective activation checkpointing of each block (its `op` SAC): in the
    backward pass each block's forward runs again, but for the ops whose outputs its policy saved (attention, and
    every other matrix product: the first, third, ... of each block's forward). Priced as those forward ops once
    more, as the backward begins. Not counted: the casts a recomputed FP8 GEMM makes again (torchao's amax is saved)."""
    from bench.tasks.base import block_of

    again, products = [], {}
    for op in trace.ops:
        block = block_of(op.module, blocks)
        if op.phase != "forward" or op.kind in ("view", "attention") or block is None:
            continue
        if op.kind == "gemm":
            products[block] = products.get(block, 0) + 1
            if products[block] % 2 == 1:  # saved
                continue
        again.append(replace(op, phase="backward"))
    start = next(i for i, op in enumerate(trace.ops) if op.phase == "backward")
    note = f"each block of {blocks} recomputed in the backward as torchtitan's per-op SAC does"
    return replace(trace, ops=[*trace.ops[:start], *again, *trace.ops[start:]],
                   note="; ".join(filter(None, [trace.note, note])))

