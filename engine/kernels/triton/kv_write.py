"""The step's new K/V rows into their pool slots (vLLM's `reshape_and_cache`, for the head-major pool)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.launch import Launch


@triton.jit
def _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cb, stride_co,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping + token)
    if slot >= 0:  # a negative slot is a padded row (a CUDA graph's spare batch room): nothing to write
        d = tl.arange(0, D_PAD)
        mask = d < HEAD_DIM
        k = tl.load(key + token * stride_kt + head * stride_kh + d, mask=mask)
        v = tl.load(value + token * stride_vt + head * stride_vh + d, mask=mask)
        dst = head * stride_ch + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + d
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, kv_heads, D] -> k_cache/v_cache [kv_heads, num_blocks, block_size, D] at `slot_mapping` [T]."""
    if key.shape[0]:
        write_kv_launch(k_cache, v_cache, key, value, slot_mapping).run()


def write_kv_launch(k_cache, v_cache, key, value, slot_mapping) -> Launch:
    tokens, kv_heads, head_dim = key.shape
    assert k_cache.stride() == v_cache.stride() and key.stride(-1) == 1 and value.stride(-1) == 1
    return Launch(_write_kv_kernel, (tokens, kv_heads), (
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
        dict(BLOCK_SIZE=k_cache.shape[2], HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim)))
