"""Chunked prefill over the flat batch, one call a layer: each sequence's new rows attend causally to its cached
prefix and to themselves, read from the pool after the step's K/V were written (as vLLM's Triton backend does).
This one kernel serves a fresh prompt, a chunk over a cached prefix or a prefix-cache hit, and speculative
verification rows; a one-row chunk is a decode.

A program takes one tile of BLOCK_Q query tokens of one sequence and one KV head, with the tile's query heads of
that KV head stacked as rows (token-major), so each K/V block is read once for the group. The rows are packed, not
padded per token: a group of 6 (Qwen2.5-1.5B's 12 heads over 2) fills 60 of 64 rows with 10 tokens, where padding
each token's group to 8 filled 48 with 8 (vLLM's unified Triton attention packs the same way). Context past the
tile's last position is never read, and only the tiles that reach past the tile's first position pay for the causal
mask: the ones before it are seen whole by every row (FlashAttention-2's split of the causal loop).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.common import (INTERPRETED, LOG2E, MIN_DOT, dot_flags, launch_options, load_kv_tile,
                                         score_shape_args, soft_cap, tile_for)
from engine.kernels.triton.launch import Launch

ROWS_PER_PROGRAM = 64  # query rows a program takes: BLOCK_Q tokens x the group, packed


def _attend_tile(q, m, l, acc, k_cache, v_cache, table, key_position, tile_end, position, context_len, qk_scale,
                 window, cap, d, d_ok, head_offset, stride_cb, stride_co, BLOCK_SIZE: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, WINDOWED: tl.constexpr,
                 CAPPED: tl.constexpr):
    """One step of the online softmax over the context tile at `key_position` (scores in log2 units): each row's
    running max, sum and output, updated. MASKED: the tile reaches past some row's position (or a window's edge), so
    each score is checked; else every row sees every key of it."""
    k, v = load_kv_tile(k_cache, v_cache, table, key_position, key_position < tile_end, d, d_ok, head_offset,
                        stride_cb, stride_co, BLOCK_SIZE, DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if CAPPED:
        s = soft_cap(s, cap)
    if MASKED:
        seen = (key_position[None, :] <= position[:, None]) & (key_position[None, :] < context_len)
        if WINDOWED:
            seen = seen & (key_position[None, :] > position[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # finite without a window: key 0 is visible to every row
    if WINDOWED:  # a row may see nothing in a tile before its window: its terms stay 0, not NaN
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)


# plain Python under the interpreter, as common.py's helpers (see its note); a device function when compiled
attend_tile = _attend_tile if INTERPRETED else triton.jit(_attend_tile)


@triton.jit
def _prefill_kernel(query, k_cache, v_cache, block_tables, query_starts, context_lens, out, qk_scale,
                    stride_qt, stride_qh, stride_ch, stride_cb, stride_co, stride_bt, stride_ot, stride_oh, window, cap,
                    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
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

        rows = tl.arange(0, ROWS)
        token = tile * BLOCK_Q + rows // GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
        heads = kv_head * GROUP + rows % GROUP
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        row_ptr = (q_start + token)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(query + row_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
        position = prefix_len + token  # of each query row in its sequence
        offsets = tl.arange(0, TILE)
        table = block_tables + seq * stride_bt
        head_offset = kv_head.to(tl.int64) * stride_ch

        m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l = tl.full([ROWS], 0.0, dtype=tl.float32)
        acc = tl.full([ROWS, D_PAD], 0.0, dtype=tl.float32)
        first = prefix_len + tile * BLOCK_Q  # the tile's first position: every row sees the keys up to it
        tile_end = tl.minimum(first + BLOCK_Q, context_len)  # one past the tile's last position
        if WINDOWED:  # the first row sees back to here, no row further: earlier tiles are not read, none is whole
            start_tile = tl.maximum(first - window + 1, 0) // TILE
            whole_end = start_tile
        else:
            start_tile = 0
            whole_end = (first + 1) // TILE
        for t in range(start_tile, whole_end):
            m, l, acc = attend_tile(q, m, l, acc, k_cache, v_cache, table, t * TILE + offsets, tile_end, position,
                                    context_len, qk_scale, window, cap, d, d_ok, head_offset, stride_cb, stride_co,
                                    BLOCK_SIZE, DOT_DTYPE, PRECISION, False, WINDOWED, CAPPED)
        for t in range(whole_end, (tile_end + TILE - 1) // TILE):  # not tl.cdiv: see common.py's note
            m, l, acc = attend_tile(q, m, l, acc, k_cache, v_cache, table, t * TILE + offsets, tile_end, position,
                                    context_len, qk_scale, window, cap, d, d_ok, head_offset, stride_cb, stride_co,
                                    BLOCK_SIZE, DOT_DTYPE, PRECISION, True, WINDOWED, CAPPED)
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
    rows = max(triton.next_power_of_2(rows_per_program), triton.next_power_of_2(group), MIN_DOT)
    block_q = rows // group
    grid = (context_lens.shape[0], triton.cdiv(max_query_len, block_q), kv_heads)
    shape_args, shape_flags = score_shape_args(shape, scaling)
    return Launch(_prefill_kernel, grid, (
        query, k_cache, v_cache, block_tables, query_starts, context_lens, out, scaling * LOG2E,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *shape_args),
        dict(GROUP=group, ROWS=rows, BLOCK_Q=block_q, HEAD_DIM=head_dim,
             D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, TILE=tile or tile_for(block_size),
             **dot_flags(query.dtype), **shape_flags), launch_options(num_warps, num_stages))
