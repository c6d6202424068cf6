"""The decoder's small per-layer ops as one Triton kernel each: the residual add with RMSNorm, the rotary embedding
of q and k in place (with the layer's K/V write into the pool folded in, `rotary_write_kv`), and SiLU(gate) * up.
Written in torch they are about 30 kernels a layer on CUDA (the norm's casts, the rotary's halves and `cat`), and on
the first H100 run they took 1.9 of a batch-256 decode step's 4.7 ms of GPU time
(benchmarks/results/gpu-check-20261127-h100/profile-256.txt). The Triton twins of `engine/csrc/fused_ops_cpu.cpp`:
the same calls, the same rounding (transformers' Llama code: the residual sum and each op's output in the model's
dtype, the arithmetic in fp32), so a model takes either as its `fused` ops.

A program takes a few rows: sizes are small enough that one row never needs a loop, and the count of programs
stays low under triton's interpreter, where each costs a Python call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import round_to_fp8, silu_mul
from engine.kernels.triton.kv_write import fp8_format
from engine.kernels.triton.launch import Launch

ELEMENTS_PER_PROGRAM = 4096  # a norm program takes this many elements' worth of whole rows
ROTARY_PAIRS_PER_PROGRAM = 2048  # rotary: (head, column) pairs of each half; whole tokens, all their q and k heads
SILU_TOKENS, SILU_COLUMNS = 4, 1024


@triton.jit
def _add_rms_norm_kernel(x, residual, weight, normed, total, rows, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (row < rows)[:, None] & (cols < hidden)[None, :]
    offsets = row.to(tl.int64)[:, None] * hidden + cols[None, :]
    summed = tl.load(x + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # rounded to the model's dtype before the norm reads it, as the torch add is
        summed = (summed.to(tl.float32) + tl.load(residual + offsets, mask=mask, other=0.0).to(tl.float32))
        summed = summed.to(total.dtype.element_ty)
        tl.store(total + offsets, summed, mask=mask)
    s = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, axis=1) / hidden + eps)
    n = (s * inv[:, None]).to(normed.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(normed + offsets, (n * w[None, :]).to(normed.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(qkv, positions, cos, sin, tokens, stride_t, max_position, q_weight, k_weight, eps,
                   k_cache, v_cache, slot_mapping, stride_ch, stride_cb, stride_co,
                   HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, NORM: tl.constexpr, Q_HEADS: tl.constexpr, ROTATED: tl.constexpr,
                   WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_MANTISSA: tl.constexpr,
                   FP8_MIN_NORMAL: tl.constexpr, FP8_LARGEST: tl.constexpr):
    pairs = tl.arange(0, BLOCK_T * HEADS_PAD)  # (token, head) pairs, token-major
    token = tl.program_id(0) * BLOCK_T + pairs // HEADS_PAD
    head = pairs % HEADS_PAD
    i = tl.arange(0, HALF_PAD)
    position = tl.load(positions + token, mask=token < tokens, other=0)
    live = (token < tokens) & (head < HEADS)
    # the engine never schedules a position past the table; the mask only keeps a bad one from reading past it
    row_ok = live & (head < ROTATED) & (position >= 0) & (position < max_position)
    mask = row_ok[:, None] & (i < HALF)[None, :]
    table = position.to(tl.int64)[:, None] * HALF + i[None, :]
    # the table in the model's dtype first, as transformers casts cos/sin before multiplying
    c = tl.load(cos + table, mask=mask, other=0.0).to(qkv.dtype.element_ty).to(tl.float32)
    s = tl.load(sin + table, mask=mask, other=0.0).to(qkv.dtype.element_ty).to(tl.float32)
    first = qkv + token.to(tl.int64)[:, None] * stride_t + head[:, None] * (2 * HALF) + i[None, :]
    # with WRITE_KV the V heads come along unrotated, to be copied into the pool
    read = (live if WRITE_KV else row_ok)[:, None] & (i < HALF)[None, :]
    x1 = tl.load(first, mask=read, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=read, other=0.0).to(tl.float32)
    if NORM:  # Qwen3's per-head RMSNorm first, rounded as the torch ops round it: the norm, then its weight
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        is_q = (head < Q_HEADS)[:, None]
        for_half = i < HALF
        w1 = tl.where(is_q, tl.load(q_weight + i, mask=for_half, other=0.0).to(tl.float32)[None, :],
                      tl.load(k_weight + i, mask=for_half, other=0.0).to(tl.float32)[None, :])
        w2 = tl.where(is_q, tl.load(q_weight + HALF + i, mask=for_half, other=0.0).to(tl.float32)[None, :],
                      tl.load(k_weight + HALF + i, mask=for_half, other=0.0).to(tl.float32)[None, :])
        x1 = tl.where(mask, ((x1 * inv[:, None]).to(qkv.dtype.element_ty).to(tl.float32) * w1).to(qkv.dtype.element_ty)
                      .to(tl.float32), x1)
        x2 = tl.where(mask, ((x2 * inv[:, None]).to(qkv.dtype.element_ty).to(tl.float32) * w2).to(qkv.dtype.element_ty)
                      .to(tl.float32), x2)
    out1 = tl.where(mask, x1 * c - x2 * s, x1).to(qkv.dtype.element_ty)
    out2 = tl.where(mask, x2 * c + x1 * s, x2).to(qkv.dtype.element_ty)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    if WRITE_KV:  # the K heads as rotated and the V heads into their pool slots: the KV write's kernel saved
        slot = tl.load(slot_mapping + token, mask=token < tokens, other=-1).to(tl.int64)
        is_k = head < ROTATED
        kv_head = tl.where(is_k, head - Q_HEADS, head - ROTATED).to(tl.int64)
        # a negative slot is a padded row (a CUDA graph's spare batch room): nothing to write
        write = (live & (head >= Q_HEADS) & (slot >= 0))[:, None] & (i < HALF)[None, :]
        dst = kv_head * stride_ch + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
        dst = dst[:, None] + i[None, :]
        y1, y2 = out1, out2
        if FP8_MANTISSA:  # as the KV write rounds: torch's cast of the model's dtype
            y1 = round_to_fp8(out1.to(tl.float32), FP8_MANTISSA, FP8_MIN_NORMAL, FP8_LARGEST)
            y2 = round_to_fp8(out2.to(tl.float32), FP8_MANTISSA, FP8_MIN_NORMAL, FP8_LARGEST)
        y1, y2 = y1.to(k_cache.dtype.element_ty), y2.to(k_cache.dtype.element_ty)
        tl.store(k_cache + dst, y1, mask=write & is_k[:, None])
        tl.store(k_cache + dst + HALF, y2, mask=write & is_k[:, None])
        tl.store(v_cache + dst, y1, mask=write & ~is_k[:, None])
        tl.store(v_cache + dst + HALF, y2, mask=write & ~is_k[:, None])


@triton.jit
def _silu_and_mul_kernel(gate_up, out, tokens, inner, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (token < tokens)[:, None] & (cols < inner)[None, :]
    rows = token.to(tl.int64)[:, None]
    gate = tl.load(gate_up + rows * (2 * inner) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + rows * (2 * inner) + inner + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out + rows * inner + cols[None, :], silu_mul(gate, up, out.dtype.element_ty), mask=mask)


def add_rms_norm_launch(x, residual, weight, normed, total, eps: float) -> Launch:
    rows, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    per_program = max(1, ELEMENTS_PER_PROGRAM // block)
    return Launch(_add_rms_norm_kernel, (triton.cdiv(rows, per_program),),
                  (x, x if residual is None else residual, weight, normed, total, rows, hidden, eps),
                  dict(HAS_RESIDUAL=residual is not None, ROWS=per_program, BLOCK=block))


def rotary_launch(qkv, positions, cos, sin, q_heads: int, kv_heads: int, head_dim: int, head_norms=None,
                  kv=None) -> Launch:
    """`head_norms`: (q weight, k weight, eps); `kv`: (k_cache, v_cache, slot_mapping), where the K and V heads are
    also written into the pool."""
    tokens, half = qkv.shape[0], head_dim // 2
    heads = q_heads + (2 if kv is not None else 1) * kv_heads
    heads_pad, half_pad = triton.next_power_of_2(heads), triton.next_power_of_2(half)
    per_program = max(1, ROTARY_PAIRS_PER_PROGRAM // (heads_pad * half_pad))
    q_weight, k_weight, eps = head_norms or (cos, cos, 0.0)  # unread without NORM
    k_cache, v_cache, slot_mapping = kv or (qkv, qkv, positions)  # unread without WRITE_KV
    assert kv is None or (k_cache.stride() == v_cache.stride() and k_cache.shape[-1] == head_dim)
    return Launch(_rotary_kernel, (triton.cdiv(tokens, per_program),),
                  (qkv, positions, cos, sin, tokens, qkv.stride(0), cos.shape[0], q_weight, k_weight, eps,
                   k_cache, v_cache, slot_mapping, *_pool_strides(kv)),
                  dict(HEADS=heads, HEADS_PAD=heads_pad, HALF=half, HALF_PAD=half_pad, BLOCK_T=per_program,
                       NORM=head_norms is not None, Q_HEADS=q_heads, ROTATED=q_heads + kv_heads,
                       WRITE_KV=kv is not None, BLOCK_SIZE=k_cache.shape[2] if kv is not None else 1,
                       **fp8_format(k_cache.dtype)))


def _pool_strides(kv) -> tuple[int, int, int]:
    """A pool's head, block and in-block strides; zeros where no pool is written."""
    return (0, 0, 0) if kv is None else tuple(kv[0].stride()[:3])


def silu_and_mul_launch(gate_up, out) -> Launch:
    tokens, inner = out.shape
    return Launch(_silu_and_mul_kernel, (triton.cdiv(tokens, SILU_TOKENS), triton.cdiv(inner, SILU_COLUMNS)),
                  (gate_up, out, tokens, inner), dict(BLOCK_T=SILU_TOKENS, BLOCK_I=SILU_COLUMNS))


def _check_rotary(qkv, positions, cos, sin, head_dim: int, head_norms) -> None:
    assert qkv.dim() == 2 and qkv.stride(1) == 1 and positions.shape == (qkv.shape[0],)
    assert cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] == head_dim // 2
    assert head_norms is None or all(w.dtype == qkv.dtype and w.shape == (head_dim,) for w in head_norms[:2])


class TritonFusedOps:
    """The model's `fused` ops (see `LlamaForCausalLM.use_fused_ops`) where attention runs on Triton."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weight * norm(x + residual), x + residual); without a residual the sum is x itself."""
        assert x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype
        assert residual is None or (residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype)
        normed = torch.empty_like(x)
        total = x if residual is None else torch.empty_like(x)
        if x.shape[0]:
            add_rms_norm_launch(x, residual, weight, normed, total, eps).run()
        return normed, total

    norms_heads = True  # rotary_inplace takes Qwen3's q/k norms (the C++ ops' does not)

    @staticmethod
    def rotary_inplace(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotated_heads: int, head_dim: int, head_norms: tuple | None = None) -> None:
        """Rotates the first `rotated_heads` heads of each row of qkv [T, heads_total * D] in place (q then k, halves
        convention), at each token's position in the fp32 tables cos/sin [max_position, D / 2]. `head_norms`:
        (q weight, k weight, eps, q heads), each head RMSNorm-ed first (Qwen3), saving 6 kernels a layer."""
        _check_rotary(qkv, positions, cos, sin, head_dim, head_norms)
        q_heads = 0 if head_norms is None else head_norms[3]
        if qkv.shape[0]:
            rotary_launch(qkv, positions, cos, sin, q_heads, rotated_heads - q_heads, head_dim,
                          None if head_norms is None else head_norms[:3]).run()

    @staticmethod
    def rotary_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        q_heads: int, kv_heads: int, head_dim: int, kv: tuple, head_norms: tuple | None = None) -> None:
        """rotary_inplace over the q and k heads of qkv [T, (q_heads + 2 * kv_heads) * D], then the rotated K and the
        V heads written into the layer's pool, `kv` (k_cache, v_cache, slot_mapping), as `write_kv` writes them: one
        kernel instead of two a layer (vLLM's `fused_rotary_embedding_and_reshape_cache_kernel` does the same on
        CUDA). `head_norms`: (q weight, k weight, eps)."""
        _check_rotary(qkv, positions, cos, sin, head_dim, head_norms)
        assert qkv.shape[1] == (q_heads + 2 * kv_heads) * head_dim and kv[2].shape == positions.shape
        if qkv.shape[0]:
            rotary_launch(qkv, positions, cos, sin, q_heads, kv_heads, head_dim, head_norms, kv).run()

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up over the merged gate/up output [T, 2 * I] -> [T, I]."""
        assert gate_up.dim() == 2 and gate_up.is_contiguous()
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        if gate_up.shape[0]:
            silu_and_mul_launch(gate_up, out).run()
        return out
