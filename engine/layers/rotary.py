"""Rotary position embedding from a cos/sin table computed once, indexed by each token's position.

The inverse frequencies (and the attention factor of scaled variants) come from transformers' own RoPE functions,
so `llama3`, `linear`, `yarn` and `longrope` scaling read exactly as the checkpoint's config says; `dynamic`
depends on the sequence length at run time and is left to the HF fallback (see `engine/models/__init__.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


def rope_type(hf_config) -> str:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return params.get("rope_type", "default")


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    kind = rope_type(hf_config)
    if kind == "default":
        base = hf_config.rope_parameters["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    return ROPE_INIT_FUNCTIONS[kind](hf_config)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_position: int):
        super().__init__()
        inv_freq, scale = inverse_frequencies(hf_config, head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos", (freqs.cos() * scale), persistent=False)  # [max_position, head_dim / 2]
        self.register_buffer("sin", (freqs.sin() * scale), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, fused=None) -> "StepRope":
        """This step's rotary inputs, shared by every layer: cos and sin [T, 1, D/2] at each token's position, looked
        up once; or, with fused ops, the positions and the fp32 tables they index themselves."""
        if fused is not None:
            return StepRope(self.cos, self.sin, positions, fused)
        return StepRope(self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


@dataclass
class StepRope:
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None = None
    fused: object = None  # the C++ or Triton fused ops (LlamaForCausalLM.use_fused_ops)

    @property
    def norms_heads(self) -> bool:
        """Whether `rotate` can RMSNorm each head first, in the same kernel (the Triton ops)."""
        return getattr(self.fused, "norms_heads", False)

    @property
    def writes_kv(self) -> bool:
        """Whether `rotate` can also write the layer's K and V into the pool, in the same kernel (the Triton ops)."""
        return hasattr(self.fused, "rotary_write_kv")

    def rotate(self, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_norms: tuple | None = None,
               kv: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, D] and k [T, kv_heads, D], views at the start of the merged projection qkv, rotated;
        `head_norms` (q weight, k weight, eps) only where `norms_heads`: each head normed first; `kv` (k_cache,
        v_cache, slot_mapping) only where `writes_kv`: K as rotated and V (qkv's last heads) written there too."""
        if self.fused is None:
            return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        if kv is not None:
            self.fused.rotary_write_kv(qkv, self.positions, self.cos, self.sin, q.shape[1], k.shape[1], q.shape[2], kv,
                                       head_norms)
            return q, k
        extra = () if head_norms is None else ((*head_norms, q.shape[1]),)
        self.fused.rotary_inplace(qkv, self.positions, self.cos, self.sin, q.shape[1] + k.shape[1], q.shape[2], *extra)
        return q, k


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in the halves convention of HF's `rotate_half`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
