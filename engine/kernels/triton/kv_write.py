"""The step's new K/V rows into their pool slots (vLLM's `reshape_and_cache`, for the head-major pool)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import round_to_fp8
from engine.kernels.triton.launch import Launch
from engine.layers.kv_cache_dtype import MANTISSA_BITS, is_fp8

TOKENS_PER_PROGRAM = 16


@triton.jit
def _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping, num_tokens,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cb, stride_co,
                     KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                     FP8_MANTISSA: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_LARGEST: tl.constexpr):
    rows = tl.arange(0, BLOCK_T * HEADS_PAD)  # (token, head) pairs, token-major
    token = tl.program_id(0) * BLOCK_T + rows // HEADS_PAD
    head = rows % HEADS_PAD
    slot = tl.load(slot_mapping + token, mask=token < num_tokens, other=-1).to(tl.int64)
    # a negative slot is a padded row (a CUDA graph's spare batch room): nothing to write
    row_ok = (token < num_tokens) & (head < KV_HEADS) & (slot >= 0)
    d = tl.arange(0, D_PAD)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key + token[:, None] * stride_kt + head[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value + token[:, None] * stride_vt + head[:, None] * stride_vh + d[None, :], mask=mask)
    if FP8_MANTISSA:  # an fp8 cache (kv_cache_dtype): rounded and saturated as torch's cast would, then cast exactly
        k = round_to_fp8(k.to(tl.float32), FP8_MANTISSA, FP8_MIN_NORMAL, FP8_LARGEST)
        v = round_to_fp8(v.to(tl.float32), FP8_MANTISSA, FP8_MIN_NORMAL, FP8_LARGEST)
    dst = head.to(tl.int64) * stride_ch + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
    tl.store(k_cache + dst[:, None] + d[None, :], k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst[:, None] + d[None, :], v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, kv_heads, D] -> k_cache/v_cache [kv_heads, num_blocks, block_size, D] at `slot_mapping` [T]."""
    if key.shape[0]:
        write_kv_launch(k_cache, v_cache, key, value, slot_mapping).run()


def write_kv_launch(k_cache, v_cache, key, value, slot_mapping) -> Launch:
    tokens, kv_heads, head_dim = key.shape
    assert k_cache.stride() == v_cache.stride() and key.stride(-1) == 1 and value.stride(-1) == 1
    return Launch(_write_kv_kernel, (triton.cdiv(tokens, TOKENS_PER_PROGRAM),), (
        key, value, k_cache, v_cache, slot_mapping, tokens, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
        dict(KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(kv_heads), BLOCK_T=TOKENS_PER_PROGRAM,
             BLOCK_SIZE=k_cache.shape[2], HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
             **fp8_format(k_cache.dtype)))


def fp8_format(cache_dtype: torch.dtype) -> dict:
    """The cache's fp8 format as the kernel rounds to it; FP8_MANTISSA 0 where the cache is not fp8."""
    if not is_fp8(cache_dtype):
        return dict(FP8_MANTISSA=0, FP8_MIN_NORMAL=0.0, FP8_LARGEST=0.0)
    info = torch.finfo(cache_dtype)
    return dict(FP8_MANTISSA=MANTISSA_BITS[cache_dtype], FP8_MIN_NORMAL=info.smallest_normal, FP8_LARGEST=info.max)
