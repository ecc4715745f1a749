"""Master weights in BF16 (train.master_weights): the parameters a mixed-precision run keeps, stored in BF16
instead of FP32, and how each optimiser step lands in them.

- `fp32`: today's FP32 master weights (nothing here runs).
- `bf16`: each updated weight rounded to nearest BF16, as an optimiser stepping BF16 parameters does (torchao's
  `_AdamW` on BF16 parameters, torch's on a BF16 model): an update under half a BF16 step of its weight is lost.
- `bf16_stochastic`: rounded stochastically (up with probability proportional to the distance, so the expected
  weight is the FP32 one: Zamirai et al., "Revisiting BFloat16 Training", 2020; torchao's
  `bf16_stochastic_round=True`), from the global torch generator, so a checkpoint's RNG state resumes it.
- `bf16_kahan`: rounded to nearest, with a BF16 compensation buffer per parameter carrying what the rounding lost
  into the next step (Kahan summation of the updates; Zamirai et al.'s second method). Kept in the optimiser's
  state, so that checkpoints hold it and the record counts its bytes.

Emulated on FP32 carriers, bit for bit: the weights hold BF16 values (rounded once at the start), the gradients are
rounded to BF16 after the backward pass (a BF16 parameter's gradient is BF16), the optimiser computes in FP32 as
torchao's and torch's do from BF16 parameters, and the result is rounded as above. The record counts parameters
and gradients at two bytes (bench/numerics/memory.py). A step the loss scaler skipped changes nothing: rounding a
BF16 value gives it back, and a compensation is always under half a BF16 step of its weight.
"""

from __future__ import annotations

import torch

from bench.numerics.dtensors import is_dtensor
from bench.numerics.formats import quantise_stochastic

MASTER_WEIGHTS = ("fp32", "bf16", "bf16_stochastic", "bf16_kahan")
COMPENSATION = "compensation"  # the optimiser-state key of bf16_kahan's buffer


def _to_bf16_values(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def _round_stochastically(p: torch.Tensor) -> None:
    """p rounded stochastically to BF16 in place. A parameter FSDP2 shards (a DTensor) draws the whole parameter's
    uniforms on every rank, from the same generator, and rounds its shard with its slice of them: the ranks' draws
    are not the same numbers twice, and the result is the unsharded parameter's, bit for bit."""
    if not is_dtensor(p):
        p.copy_(quantise_stochastic(p, "bf16"))
        return
    from torch.distributed.tensor import distribute_tensor

    whole = torch.rand(p.shape, device=p.to_local().device)
    mine = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()  # no communication
    p.to_local().copy_(quantise_stochastic(p.to_local(), "bf16", draw=mine))


class MasterWeights:
    """train.master_weights for one model and optimiser: `start()` before training, `after_backward()` and
    `after_step()` around each optimiser step."""

    def __init__(self, mode: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.mode, self.optimizer = mode, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]

    @property
    def active(self) -> bool:
        return self.mode != "fp32"

    @torch.no_grad()
    def start(self) -> None:
        """The model's initial weights as BF16 holds them (a resumed run's already are: a no-op)."""
        if self.active:
            for p in self.params:
                p.copy_(_to_bf16_values(p))

    def after_backward(self) -> None:
        if self.active:  # checked before entering no_grad: FP32 masters pay nothing a step
            self._round_gradients()

    def after_step(self) -> None:
        if self.active:
            self._round_weights()

    @torch.no_grad()
    def _round_gradients(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.copy_(_to_bf16_values(p.grad))

    @torch.no_grad()
    def _round_weights(self) -> None:
        for p in self.params:
            if self.mode == "bf16":
                p.copy_(_to_bf16_values(p))
            elif self.mode == "bf16_stochastic":
                _round_stochastically(p)
            else:
                state = self.optimizer.state[p]
                if not state and "betas" in self.optimizer.defaults:
                    continue  # Adam (torch's, torchao's) makes its state on its first step, from an empty one: a
                    # skipped first step has none yet, and a compensation there would stop it being made
                compensation = state.setdefault(COMPENSATION, torch.zeros_like(p, dtype=torch.bfloat16))
                exact = p + compensation.float()
                rounded = _to_bf16_values(exact)
                compensation.copy_((exact - rounded).to(torch.bfloat16))  # BF16 even where a resume made it FP32
                p.copy_(rounded)
