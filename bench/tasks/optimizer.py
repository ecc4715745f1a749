"""A model's optimiser, as its yaml (`model.optimizer`) declares it: what the runner trains with and what the speed
model's tracer steps (bench/speed/trace.py), so both see the same fused kernel and the same parameter groups."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
from omegaconf import DictConfig
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from bench.errors import ConfigError
from bench.numerics.dtensors import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# model.optimizer.state_format: Adam's moments as stored (`low_bit_adam`), a storage type, not a GEMM format
STATE_FORMATS = ("fp32", "bf16", "int8", "int4", "fp8")
# bytes a moment's element takes in each (the block formats: their codes and an FP32 scale per block of 256, int4's
# of 128), where torchao stores it so (`held_in_state_format`)
STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 128, "fp8": 1 + 4 / 256}
STATE_BLOCK = {"fp32": 1, "bf16": 1, "int8": 256, "int4": 128, "fp8": 256}  # elements per scale (torchao's)
STATE_CODE_BOOK_BYTES = {"int8": 256 * 4, "int4": 16 * 4}  # each quantised moment's own FP32 code book (its qmap)


def held_in_state_format(elements: int, state_format: str) -> bool:
    """Whether torchao stores a moment of `elements` (a rank's shard under FSDP2) in `state_format`: 4,096 elements
    or more, in whole blocks (bitsandbytes' rule, torchao.optim's `_new_buffer`); else in the parameter's type."""
    return elements >= 4096 and elements % STATE_BLOCK[state_format] == 0


def build_optimizer(cfg: DictConfig, params, lr_multipliers: dict | None = None,
                    parameter_groups: Callable[[list, float], list] | None = None) -> torch.optim.Optimizer:
    """torch's optimiser, fused where the device has the kernel (CPU and CUDA do): one kernel per step, and
    the only way to skip an overflowing step without reading found_inf on the host (GradScaler's route).
    decay_matrices_only: weight decay on parameters of two or more dimensions only (nanoGPT's groups).
    lr_multipliers: parameter -> factor k on cfg.lr, its weight decay divided by k (one group per factor; schedules
    scale every group alike): AdamW's decoupled decay shrinks a weight by lr * weight_decay per step, so the
    shrink per step stays what it was while Adam's step grows k-fold (bench/numerics/unit.py's relative rule).
    parameter_groups: the scaling method's groups instead (its `parameter_groups`; u-μP's: cfg.lr is its global
    learning rate, scaled per parameter by type and depth, the weight decay independent of it)."""
    params = list(dict.fromkeys(params))  # a tied parameter once
    fused = bool(params) and params[0].device.type in _get_fused_kernels_supported_devices() \
        and not is_dtensor(params[0])  # FSDP2's sharded parameters: torch's fused kernels take no DTensor
    groups = {}
    for p in params:
        decay = cfg.weight_decay if p.dim() >= 2 or not cfg.decay_matrices_only else 0.0
        factor = 1.0 if lr_multipliers is None else lr_multipliers.get(p, 1.0)
        groups.setdefault((decay, factor), []).append(p)
    groups = [{"params": members, "weight_decay": decay / factor, "lr": cfg.lr * factor}
              for (decay, factor), members in groups.items()]
    if parameter_groups is not None:
        groups = parameter_groups(groups, cfg.lr)
    sgd, adam, adamw = torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW
    if params and params[0].device.type == "xla":
        # torch_xla's sync-free subclasses of the same optimisers skip a step on a found_inf flag on the device
        # (step(found_inf=...)), where torch's would need it read on the host at every step
        from torch_xla.amp import syncfree

        sgd, adam, adamw = syncfree.SGD, syncfree.Adam, syncfree.AdamW
    kernel = {"fused": True} if fused else {}  # (the sync-free optimisers take no `fused`)
    if cfg.name == "sgd":
        optimizer = sgd(groups, lr=cfg.lr, momentum=cfg.momentum, **kernel)
        if fused and cfg.momentum:
            # torch's fused SGD makes its momentum buffers with empty_like on the first step and fills them in
            # the kernel, which a found_inf skip leaves out: the next step reads garbage. Zeros are the same
            # first step bit for bit (buf = momentum * 0 + grad, no dampening) and survive a skip.
            for p in params:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return optimizer
    if cfg.get("state_format", "fp32") != "fp32":
        if params and params[0].device.type == "xla":
            raise ConfigError(f"model.optimizer.state_format={cfg.state_format}: torchao's optimisers do not run on "
                              "XLA; valid there: fp32")
        return low_bit_adam(cfg, groups)
    return (adam if cfg.name == "adam" else adamw)(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), **kernel)


def traced_config(cfg: DictConfig) -> DictConfig:
    """The optimiser the speed model's tracer steps: FP32 states. torchao's low-bit steps compile inside, which a
    traced step (under a dispatch mode, on the meta device) cannot do; the speed model reprices the traced step's
    bytes by the cell's state format (`StepTrace.state_format`)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(cfg, {"state_format": "fp32"}) if cfg.get("state_format", "fp32") != "fp32" else cfg


def low_bit_adam(cfg: DictConfig, groups: list) -> torch.optim.Optimizer:
    """Adam or AdamW whose moments are stored in `cfg.state_format`: torchao's block-wise int8 (bitsandbytes' 8-bit
    Adam: blocks of 256, a dynamic-tree code), int4 (blocks of 128) and FP8 (E4M3, blocks of 256) states, or BF16
    states (`_bf16_state_adam`, on torchao's same step). As torchao and bitsandbytes do, a tensor under 4,096 elements
    (biases, norms) keeps FP32 moments; every step is computed in FP32 and only the stored moments are rounded."""
    from torchao import optim as low_bit

    classes = {("adamw", "int8"): low_bit.AdamW8bit, ("adamw", "int4"): low_bit.AdamW4bit,
               ("adamw", "fp8"): low_bit.AdamWFp8, ("adam", "int8"): low_bit.Adam8bit,
               ("adam", "int4"): low_bit.Adam4bit, ("adam", "fp8"): low_bit.AdamFp8}
    if cfg.state_format == "bf16":
        return _sharded_alike(_bf16_state_adam(), "bf16")(groups, lr=cfg.lr, betas=(0.9, cfg.beta2),
                                                          is_adamw=cfg.name == "adamw")
    return _sharded_alike(classes[cfg.name, cfg.state_format], cfg.state_format)(groups, lr=cfg.lr,
                                                                                 betas=(0.9, cfg.beta2))


def _shard_elements(p: DTensor) -> list[int]:
    """Every rank's elements of `p`, which FSDP2 shards along one dimension as torch.chunk splits it (shards of
    ceil(rows / ranks), the last short or empty)."""
    ranks, (placement,) = p.device_mesh.size(), p.placements
    if not placement.is_shard():
        return [p.numel()] * ranks
    rows = [len(chunk) for chunk in torch.arange(p.shape[placement.dim]).chunk(ranks)]
    per_row = p.numel() // max(1, p.shape[placement.dim])
    return [n * per_row for n in rows + [0] * (ranks - len(rows))]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if is_dtensor(t) else t


@functools.cache
def _sharded_alike(cls: type, state_format: str) -> type:
    """torchao's `cls` storing a sharded parameter's moments alike on every rank. torchao judges its rule (4,096
    elements or more, in whole blocks) on each rank's own shard, and FSDP2's shards of a tensor whose rows do not
    split evenly differ: BERT-MLM tiny's 303-row embedding is 152 x 64 elements on rank 0 (whole blocks of 256) and
    151 x 64 on rank 1 (not), so the ranks held int8 and FP32 moments of one tensor and the step failed. Here a
    moment is low-bit where every rank's shard passes the rule, FP32 on every rank otherwise."""

    class ShardedAlike(cls):
        @torch.no_grad()
        def step(self, closure=None):
            """torchao's step (its `_AdamBase.step`: the same state, the same compiled `single_param_adam`), each
            update computed on this rank's shards: torch.compile of the update of an unevenly sharded DTensor
            fails in its shape checks (torchtune#1978: 'expected size 152==151'), and the update is elementwise, so
            a shard's is its part of the whole parameter's."""
            from torchao.optim.adam import single_param_adam

            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            with torch._dynamo.utils.disable_cache_limit():  # one compile per shape and state type, as torchao's
                for group in self.param_groups:
                    for p in (p for p in group["params"] if p.grad is not None):
                        state = self.state[p]
                        if not state:
                            state["step"] = torch.tensor(0.0)
                            state["exp_avg"] = self._new_buffer(p, True)
                            state["exp_avg_sq"] = self._new_buffer(p, False)
                            if group["amsgrad"]:
                                state["max_exp_avg_sq"] = self._new_buffer(p, False)
                        state["step"] += 1
                        torch.compile(single_param_adam, fullgraph=True, dynamic=False)(
                            _local(p.detach()), _local(p.grad), state["step"], _local(state["exp_avg"]),
                            _local(state["exp_avg_sq"]), _local(state.get("max_exp_avg_sq")), group["lr"],
                            *group["betas"], group["weight_decay"], group["eps"], self.is_adamw,
                            self.bf16_stochastic_round and p.dtype is torch.bfloat16)
            return loss

        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            if is_dtensor(p) and not all(held_in_state_format(n, state_format) for n in _shard_elements(p)):
                from torch.distributed.tensor import DTensor

                local = torch.zeros_like(p.to_local())
                return DTensor.from_local(local, device_mesh=p.device_mesh, placements=p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride()).to(p.device)
            return super()._new_buffer(p, signed)

    ShardedAlike.__name__ = ShardedAlike.__qualname__ = cls.__name__  # what a record names
    return ShardedAlike


@functools.cache
def _bf16_state_adam() -> type:
    """The class, made where torchao is imported (an optional dependency: only a cell that asks for it needs it)."""
    from torchao.optim.adam import _AdamBase

    class BF16StateAdam(_AdamBase):
        """torchao's Adam step with its two moments stored in BF16 (rounded to nearest after each FP32 update),
        on tensors of 4,096 elements or more, as its low-bit states are: torchao has no BF16-state Adam for FP32
        parameters."""

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, is_adamw=True):
            super().__init__(params, lr, betas, eps, weight_decay, False, block_size=1,
                             bf16_stochastic_round=False, is_adamw=is_adamw)

        @staticmethod
        def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
            return torch.zeros_like(p, dtype=torch.bfloat16)

    return BF16StateAdam
