"""Whether a tensor is a DTensor (FSDP2's sharded parameters, gradients and optimiser states), without importing
torch.distributed.tensor where nothing has yet: that import is about half a second of every `bench.run` process
(a sixth of a refused command's three), and no tensor can be a DTensor before it."""

from __future__ import annotations

import sys

import torch


def is_dtensor(t: torch.Tensor | None) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
