"""Word-level tokenizer for the built-in tiny model.

The vocabulary is the closed set of caption words of the built-in task, so a word the model has never
seen is an error rather than a silent ``<unk>``: the message names the word, the prompt and the
vocabulary. Two special tokens precede the words: ``<pad>`` (id 0, masked out everywhere) and
``<null>`` (id 1), the caption of the unconditional branch of classifier-free guidance. The empty
prompt ``""`` is the null caption.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from flowcredit.errors import UserError

PAD, NULL = "<pad>", "<null>"
_SPLIT = re.compile(r"[^\s,.;:!?]+")


class Tokenizer:
    """Maps prompts to fixed-length id and mask tensors.

    Args:
        vocab: the caption words (order defines the ids; specials are prepended).
        max_len: number of token slots; longer prompts raise ``ValueError``.
    """

    def __init__(self, vocab: Sequence[str], max_len: int):
        words = [w.lower() for w in vocab]
        if len(set(words)) != len(words):
            raise ValueError(f"duplicate words in vocabulary: {sorted(words)}")
        if PAD in words or NULL in words:
            raise ValueError(f"vocabulary must not contain the special tokens {PAD!r}, {NULL!r}")
        self.vocab: tuple[str, ...] = tuple(words)
        self.max_len = int(max_len)
        self.index = {w: i + 2 for i, w in enumerate(self.vocab)}

    @property
    def size(self) -> int:
        """Number of ids, specials included."""
        return len(self.vocab) + 2

    def words(self, prompt: str) -> list[str]:
        """Lower-cased words of ``prompt`` (whitespace and punctuation separate them)."""
        return _SPLIT.findall(prompt.lower())

    def ids(self, prompt: str) -> list[int]:
        """Token ids of one prompt, unpadded; ``""`` gives ``[NULL]``."""
        words = self.words(prompt)
        if not words:
            return [1]
        out = []
        for w in words:
            if w not in self.index:
                raise UserError(
                    f"unknown word {w!r} in prompt {prompt!r}; the tiny model knows only: "
                    + ", ".join(self.vocab)
                )
            out.append(self.index[w])
        if len(out) > self.max_len:
            raise UserError(f"prompt {prompt!r} has {len(out)} words; the maximum is {self.max_len}")
        return out

    def __call__(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokenise a batch.

        Returns:
            ids: ``(B, L)`` int64, padded with 0; mask: ``(B, L)`` bool, True on real tokens.
        """
        if isinstance(prompts, str):
            raise TypeError("pass a list of prompts, not a single string")
        ids = torch.zeros(len(prompts), self.max_len, dtype=torch.long)  # (B, L)
        for b, prompt in enumerate(prompts):
            row = self.ids(prompt)
            ids[b, : len(row)] = torch.tensor(row)
        return ids, ids != 0
