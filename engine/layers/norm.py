"""RMSNorm with the residual add fused in: one call per sub-layer boundary instead of an add and a norm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.fused = None  # C++ or Triton fused ops, set by the model (LlamaForCausalLM.use_fused_ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual); the sum is the next residual. Computed in fp32, as HF does."""
        if self.fused is not None and not torch.compiler.is_compiling():
            return tuple(self.fused.add_rms_norm(x, residual, self.weight, self.eps))
        if residual is not None:
            x = x + residual
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        return normed, x
