"""FLOPs of a training step, counted by torch.utils.flop_counter: the step's total (its TFLOP/s in the record) and
each Linear's share (what native FP8 converted, `fp8_modules.converted_flop_share`)."""

from __future__ import annotations

import torch
from torch import nn

from bench.tasks import Task


def _count_cpu_attention() -> None:
    """FlopCounterMode has formulas for SDPA's CUDA kernels but not for the CPU one (torch 2.13): charlm's causal
    attention added nothing to its step's FLOPs on CPU (its Linears summed to exactly "Global"), so its TFLOP/s
    came out low. The CPU kernel takes its arguments in the same order; give it the same formulas (which count
    the full score matrix, causal or not, as torch does on CUDA)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    for cpu, cuda in ((aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention),
                      (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                       aten._scaled_dot_product_flash_attention_backward)):
        flop_registry.setdefault(cpu, flop_registry[cuda])


def step_flops_by_module(task: Task) -> dict[str, int]:
    """FLOPs of one training step (forward and backward on the first batch): "Global", all of them; per Linear,
    as FlopCounterMode names it (`<root class>.<name>`), its three GEMMs: the forward's FLOPs twice (output and
    weight gradient), thrice where its input needs a gradient. Per-module counts are taken in the forward only:
    in the backward FlopCounterMode charges an op to every module whose hooks are active when it runs, and gave
    DistilBERT's v_lin the q_lin and k_lin gradients that share its input (its Linears summed to more FLOPs
    than the step). The random streams are left as they were."""
    from torch.utils.flop_counter import FlopCounterMode

    _count_cpu_attention()
    linears = {f"{type(task.model).__name__}.{name}": m for name, m in task.model.named_modules()
               if isinstance(m, nn.Linear)}
    input_needs_grad = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, name=name: input_needs_grad.__setitem__(
        name, input_needs_grad.get(name, False) or args[0].requires_grad)) for name, m in linears.items()]
    forward, backward = FlopCounterMode(display=False), FlopCounterMode(display=False)
    try:
        with torch.random.fork_rng():
            with forward:
                outputs, targets = task.forward(task.model, next(iter(task.train_batches(0))), lambda x: x)
                loss = task.compute_loss(outputs, targets)
            with backward:
                loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    task.model.zero_grad(set_to_none=True)
    counts = forward.get_flop_counts()
    return {"Global": forward.get_total_flops() + backward.get_total_flops()} | {
        name: sum(counts[name].values()) * (3 if input_needs_grad[name] else 2)
        for name in linears if name in counts}
