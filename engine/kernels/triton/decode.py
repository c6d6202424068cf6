"""Decode attention: one query row per sequence over its paged context, online softmax.

A program takes one sequence, one KV head and one split of its context, and all the query heads that share that KV
head (GQA), so each K/V block is read once for the group; it reads the context in tiles of several blocks. The group is padded to 16 rows, the least `tl.dot` takes
on a GPU; decode is bound by reading K/V, so the idle rows cost no bandwidth. Where a batch has too few
(sequence, KV head) pairs to fill the GPU, each sequence's blocks are cut into `num_splits` parts (flash-decoding),
and a second kernel merges the parts by their log-sum-exp. The split count is a compile-time constant and each
sequence's part size is worked out inside the kernel from its own length, so a CUDA graph captured for a batch size
serves any lengths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import (LOG2E, MIN_DOT, dot_flags, launch_options, load_kv_tile, score_shape_args,
                                         soft_cap, tile_for)
from engine.kernels.triton.launch import Launch

MAX_SPLITS = 16
TOKENS_PER_SPLIT = 256  # a split shorter than this costs more in the merge than it gains in parallelism


@triton.jit
def _decode_kernel(query, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, qk_scale,
                   stride_qb, stride_qh, stride_ch, stride_cb, stride_co, stride_bt, stride_ob, stride_oh, window, cap,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   PRECISION: tl.constexpr, WINDOWED: tl.constexpr, CAPPED: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens + seq)
    # a sliding window: the last `window` keys (the query's own among them); tiles before it are not read
    window_start = tl.maximum(context_len - window, 0) if WINDOWED else 0
    # plain arithmetic and tl.full, not tl.cdiv and tl.zeros: see common.py's note on the interpreter
    num_tiles = (context_len + TILE - 1) // TILE
    start_tile = window_start // TILE
    per_split = (num_tiles - start_tile + NUM_SPLITS - 1) // NUM_SPLITS
    first_tile = start_tile + split * per_split
    last_tile = tl.minimum(first_tile + per_split, num_tiles)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(query + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    offsets = tl.arange(0, TILE)

    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.full([GROUP_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([GROUP_PAD, D_PAD], 0.0, dtype=tl.float32)
    for t in range(first_tile, last_tile):
        position = t * TILE + offsets
        visible = (position < context_len) & (position >= window_start)
        k, v = load_kv_tile(k_cache, v_cache, block_tables + seq * stride_bt, position, visible, d, d_ok,
                            kv_head.to(tl.int64) * stride_ch, stride_cb, stride_co, BLOCK_SIZE, DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if CAPPED:
            s = soft_cap(s, cap)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m = m_new

    store_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        result = acc / l[:, None]
        tl.store(out + seq * stride_ob + heads[:, None] * stride_oh + d[None, :], result.to(out.dtype.element_ty),
                 mask=store_mask)
    else:  # part_out [B, H, NUM_SPLITS, D_PAD] and part_lse [B, H, NUM_SPLITS], both fp32 and contiguous
        has_blocks = first_tile < last_tile
        result = tl.where(has_blocks, acc / tl.maximum(l, 1e-30)[:, None], 0.0)
        lse = tl.where(has_blocks, m + tl.log2(tl.maximum(l, 1e-30)), float("-inf"))
        part = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(part_out + part[:, None] * D_PAD + d[None, :], result, mask=store_mask)
        tl.store(part_lse + part, lse, mask=row_ok)


@triton.jit
def _merge_kernel(part_out, part_lse, out, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    lse = tl.load(part_lse + part)
    weights = tl.exp2(lse - tl.max(lse, 0))  # the first split always has blocks, so the max is finite
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM  # the partials' padding lanes were never written: not read either
    parts = tl.load(part_out + part[:, None] * D_PAD + d[None, :], mask=d_ok[None, :], other=0.0)
    result = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out + seq * stride_ob + head * stride_oh + d, result.to(out.dtype.element_ty), mask=d_ok)


def num_splits_for(batch: int, kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits a sequence's blocks into parts where (sequence, KV head) pairs alone leave SMs idle, each part at
    least TOKENS_PER_SPLIT long; a power of two up to MAX_SPLITS."""
    programs = batch * kv_heads
    if programs >= num_sms:
        return 1
    wanted = min(triton.cdiv(num_sms, programs), triton.cdiv(max_context, TOKENS_PER_SPLIT), MAX_SPLITS)
    return 1 if wanted <= 1 else triton.next_power_of_2(wanted)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scaling: float, num_splits: int = 1,
                     out: torch.Tensor | None = None, shape=None) -> torch.Tensor:
    """query [B, heads, D] over k_cache/v_cache [kv_heads, num_blocks, block_size, D], block_tables [B, width],
    context_lens [B] (the new token included, its K/V already written) -> [B, heads, D]. `shape`: the layer's
    ScoreShape (a sliding window, soft-capping), if any."""
    out = torch.empty_like(query) if out is None else out
    for launch in decode_launches(query, k_cache, v_cache, block_tables, context_lens, scaling, num_splits, out,
                                  shape=shape):
        launch.run()
    return out


def decode_launches(query, k_cache, v_cache, block_tables, context_lens, scaling, num_splits, out,
                    tile: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                    shape=None) -> list[Launch]:
    """The engine launches the defaults; the rest is for benchmarks/triton_attention.py's sweep (`tile`: context
    positions a loop step reads)."""
    batch, heads, head_dim = query.shape
    kv_heads, _, block_size, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and query.stride(-1) == 1 and num_splits == triton.next_power_of_2(num_splits)
    group = heads // kv_heads
    d_pad = triton.next_power_of_2(head_dim)
    parts = lse = out  # unused by a single split
    if num_splits > 1:
        parts = torch.empty((batch, heads, num_splits, d_pad), dtype=torch.float32, device=query.device)
        lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=query.device)
    shape_args, shape_flags = score_shape_args(shape, scaling)
    launches = [Launch(_decode_kernel, (batch, kv_heads, num_splits), (
        query, k_cache, v_cache, block_tables, context_lens, out, parts, lse, scaling * LOG2E,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *shape_args),
        dict(GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
             BLOCK_SIZE=block_size, TILE=tile or tile_for(block_size), NUM_SPLITS=num_splits, **dot_flags(query.dtype),
             **shape_flags),
        launch_options(num_warps, num_stages))]
    if num_splits > 1:
        launches.append(Launch(_merge_kernel, (batch, heads), (parts, lse, out, out.stride(0), out.stride(1)),
                               dict(HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits)))
    return launches
