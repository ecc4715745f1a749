"""Whether a tensor is a DTensor (FSDP2's sharded parameters, gradients and optimiser states), without importing
torch.distributed.tensor where nothing has yet: that import (sympy with it) was 0.8 s of a refused `bench.run`'s
2.6 on a 2-core AMD EPYC, and no tensor can be a DTensor before it. A training run imports it anyway."""

from __future__ import annotations

import sys

import torch


def is_dtensor(t: torch.Tensor | None) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
