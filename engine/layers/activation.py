"""SiLU(gate) * up over the merged gate/up projection's output."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor, fused=None) -> torch.Tensor:
    """fused: the C++ or Triton fused ops (LlamaForCausalLM.use_fused_ops), one call instead of three ops."""
    if fused is not None and not torch.compiler.is_compiling():
        return fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
