"""precision-bench: what a numeric format and a scaling method cost in accuracy and gain in time and memory."""

import logging

# the one home of the version: pyproject.toml reads it, every record carries it (env.version)
__version__ = "0.3.0.dev0"


class _TorchaoImportNoise(logging.Filter):
    """Drops log lines importing torchao 0.18 prints under torch 2.13 that concern no run here, which read as
    failures to a newcomer: on a machine without CUDA, "Failed to load .../torchao/_C_*.so" (its CUDA kernels'
    libraries, some built for another Python) and "Detected no triton" (Triton's kernels are CUDA's), which it never
    calls; and torch's notice that registering torchao's enums as constants is deprecated. Every other line of
    these loggers passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (message.startswith("Failed to load ") and "/torchao/_C" in message) or "Detected no triton" in message:
            import torch

            return torch.cuda.is_available()
        return not ("is an Enum subclass" in message and "register_constant()" in message)


for _name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_TorchaoImportNoise())
