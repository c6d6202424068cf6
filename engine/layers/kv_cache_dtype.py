"""The KV cache's element type (vLLM's `kv_cache_dtype`): the model's own, or one byte a value in an fp8 format.

fp8 values are stored unscaled, as vLLM stores them when a checkpoint brings no K/V scales (scale 1.0), and saturated
at the format's largest finite value rather than turned into inf or NaN. Reading them back is a plain widening.
"""
from __future__ import annotations

import torch

FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """'auto' -> the model's dtype; 'fp8' (e4m3, vLLM's meaning), 'fp8_e4m3', 'fp8_e5m2' -> that format."""
    return model_dtype if name == "auto" else FP8_FORMATS[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in MANTISSA_BITS


def as_stored(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`values` in the cache's type, saturated where that is fp8 (torch's cast gives inf past e5m2's range)."""
    if is_fp8(cache_dtype):
        largest = torch.finfo(cache_dtype).max
        return values.clamp(-largest, largest).to(cache_dtype)
    return values.to(cache_dtype)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes where it is fp8, else itself: torch 2.13 has no CPU index_copy_ or index_select for fp8,
    and moving one-byte elements as bytes is the same move."""
    return tensor.view(torch.uint8) if is_fp8(tensor.dtype) else tensor
