"""Chunked prefill over the flat batch, one call a layer: each sequence's new rows attend causally to its cached
prefix and to themselves, read from the pool after the step's K/V were written (as vLLM's Triton backend does).
This one kernel serves a fresh prompt, a chunk over a cached prefix or a prefix-cache hit, and speculative
verification rows; a one-row chunk is a decode.

A program takes one tile of BLOCK_Q query tokens of one sequence and one KV head, with the tile's query heads of
that KV head stacked as rows (token-major), so each K/V block is read once for the group. Context past the
tile's last position is never read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import (LOG2E, MIN_DOT, dot_flags, launch_options, load_kv_tile, score_shape_args,
                                         soft_cap, tile_for)
from engine.kernels.triton.launch import Launch

ROWS_PER_PROGRAM = 64  # BLOCK_Q x padded group


@triton.jit
def _prefill_kernel(query, k_cache, v_cache, block_tables, query_starts, context_lens, out, qk_scale,
                    stride_qt, stride_qh, stride_ch, stride_cb, stride_co, stride_bt, stride_ot, stride_oh, window, cap,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    PRECISION: tl.constexpr, WINDOWED: tl.constexpr, CAPPED: tl.constexpr):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_starts + seq)
    q_len = tl.load(query_starts + seq + 1) - q_start
    if tile * BLOCK_Q < q_len:
        context_len = tl.load(context_lens + seq)
        prefix_len = context_len - q_len  # tokens cached before this chunk

        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        token = tile * BLOCK_Q + rows // GROUP_PAD
        member = rows % GROUP_PAD
        row_ok = (token < q_len) & (member < GROUP)
        heads = kv_head * GROUP + member
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        row_ptr = (q_start + token)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(query + row_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
        position = prefix_len + token  # of each query row in its sequence
        offsets = tl.arange(0, TILE)

        m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l = tl.full([BLOCK_Q * GROUP_PAD], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_Q * GROUP_PAD, D_PAD], 0.0, dtype=tl.float32)
        tile_end = tl.minimum(prefix_len + (tile + 1) * BLOCK_Q, context_len)  # one past the tile's last position
        # a sliding window: the tile's first row sees back to here, and no row further; earlier tiles are not read
        start_tile = tl.maximum(prefix_len + tile * BLOCK_Q - window + 1, 0) // TILE if WINDOWED else 0
        for t in range(start_tile, (tile_end + TILE - 1) // TILE):  # not tl.cdiv: see common.py's note
            key_position = t * TILE + offsets
            k, v = load_kv_tile(k_cache, v_cache, block_tables + seq * stride_bt, key_position,
                                key_position < tile_end, d, d_ok, kv_head.to(tl.int64) * stride_ch, stride_cb, stride_co,
                                BLOCK_SIZE, DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if CAPPED:
                s = soft_cap(s, cap)
            causal = (key_position[None, :] <= position[:, None]) & (key_position[None, :] < context_len)
            if WINDOWED:
                causal = causal & (key_position[None, :] > position[:, None] - window)
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite without a window: key 0 is visible to every row
            if WINDOWED:  # a row may see nothing in a tile before its window: its terms stay 0, not NaN
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
            m = m_new
        out_ptr = (q_start + token)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        # a padding row (past the chunk, or past the group) may have seen no key in a window: 0, not 0 / 0
        tl.store(out + out_ptr, (acc / tl.maximum(l, 1e-30)[:, None]).to(out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_starts: torch.Tensor, context_lens: torch.Tensor, max_query_len: int, scaling: float,
                      out: torch.Tensor | None = None, shape=None) -> torch.Tensor:
    """query [T, heads, D], the chunks of S sequences back to back: sequence i's rows are
    query_starts[i]:query_starts[i + 1], and it has context_lens[i] tokens once they are written (their K/V are
    in the pool already). block_tables [S, width]. -> [T, heads, D]."""
    out = torch.empty_like(query) if out is None else out
    if query.shape[0] and context_lens.shape[0]:
        prefill_launch(query, k_cache, v_cache, block_tables, query_starts, context_lens, max_query_len, scaling,
                       out, shape=shape).run()
    return out


def prefill_launch(query, k_cache, v_cache, block_tables, query_starts, context_lens, max_query_len, scaling,
                   out, rows_per_program: int = ROWS_PER_PROGRAM, tile: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, shape=None) -> Launch:
    """The engine launches the defaults; the rest is for benchmarks/triton_attention.py's sweep (`tile`: context
    positions a loop step reads)."""
    _, heads, head_dim = query.shape
    kv_heads, _, block_size, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and query.stride(-1) == 1
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, rows_per_program // group_pad)
    while block_q * group_pad < MIN_DOT:
        block_q *= 2
    grid = (context_lens.shape[0], triton.cdiv(max_query_len, block_q), kv_heads)
    shape_args, shape_flags = score_shape_args(shape, scaling)
    return Launch(_prefill_kernel, grid, (
        query, k_cache, v_cache, block_tables, query_starts, context_lens, out, scaling * LOG2E,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *shape_args),
        dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
             D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, TILE=tile or tile_for(block_size),
             **dot_flags(query.dtype), **shape_flags), launch_options(num_warps, num_stages))
