"""Model adapters: the :class:`FlowModel` contract, the registry, the built-in tiny model.

The diffusers adapters (``sd3``, ``flux``, ``qwen_image``, ``wan``, ``z_image`` in this package) are
imported only when chosen (``load_model``), so ``import flowcredit.models`` needs no diffusers.
"""

from flowcredit.models.protocol import Cond, FlowModel, FlowModelBase, check_adapter
from flowcredit.models.registry import MODELS, load_model
from flowcredit.models.tiny import (
    TextCond,
    TinyConfig,
    TinyFlowModel,
    builtin_path,
    load_builtin,
    load_checkpoint,
)
from flowcredit.models.tokenizer import Tokenizer

__all__ = [
    "MODELS",
    "Cond",
    "FlowModel",
    "FlowModelBase",
    "TextCond",
    "TinyConfig",
    "TinyFlowModel",
    "Tokenizer",
    "builtin_path",
    "check_adapter",
    "load_builtin",
    "load_checkpoint",
    "load_model",
]
