"""The LM head, computed only at the positions that sample a token (the last of each sequence that finishes its
prompt or decodes), not over every prefill token."""
from __future__ import annotations

import torch

from engine.layers.linear import Linear


class LMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size)

    def forward(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden.index_select(0, logits_indices))
