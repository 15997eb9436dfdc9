"""flowcredit: GRPO fine-tuning of flow-matching text-to-image models with step-level credit assignment.

The math core lives in small torch-only modules: ``schedule``, ``sde``, ``values``, ``advantages``,
``calibration`` and ``losses``. Importing the package imports nothing heavy.
"""

__version__ = "0.1.0"

import logging as _logging


class _ImportNotices(_logging.Filter):
    """Three notices at every import of torchao 0.18 (the ``quant`` extra), which transformers and
    diffusers do whenever it is installed: torch 2.13 announces the enums it registers with pytree, its
    optional CUDA kernel libraries do not load on a CPU torch, and diffusers 0.42 misses tensor classes
    it would need to load checkpoints saved quantised. None is ours to act on (we quantise after
    loading, with weight-only layers that need none of them): these messages are dropped, nothing else."""

    def filter(self, record: _logging.LogRecord) -> bool:
        text = record.getMessage()
        enum = "is an Enum subclass and is now natively supported" in text
        kernels = text.startswith("Failed to load") and "torchao" in text
        return not (enum or kernels or text.startswith("Unable to import `torchao` Tensor objects"))


_logging.getLogger("torch.utils._pytree").addFilter(_ImportNotices())
_logging.getLogger("torchao").addFilter(_ImportNotices())
_logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").addFilter(_ImportNotices())
