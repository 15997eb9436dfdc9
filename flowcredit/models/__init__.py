"""Model adapters: the ``FlowModel`` protocol and the built-in tiny model."""

from flowcredit.models.protocol import Cond, FlowModel
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
    "Cond",
    "FlowModel",
    "TextCond",
    "TinyConfig",
    "TinyFlowModel",
    "Tokenizer",
    "builtin_path",
    "load_builtin",
    "load_checkpoint",
]
