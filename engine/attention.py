"""Paged attention, registered into transformers' attention interface so the HF modeling code runs unchanged.

The model sees one flat, unpadded batch `[1, num_tokens]`. Each layer writes its new K/V into their pool slots,
then every sequence attends over its own context read back from the pool through its block table.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTN_IMPLEMENTATION = "paged"


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    end: int
    context_len: int  # tokens in the sequence once this chunk is written
    block_table: torch.Tensor  # [num_blocks] long


@dataclass
class AttentionMetadata:
    """What one step's attention needs to know, built once per step by the model runner."""

    kv_cache: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens]: pool slot of each new token
    num_decodes: int  # single-token sequences come first in the flat batch
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_key_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] True where attended
    prefills: list[PrefillChunk]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, paged_metadata=None, **_):
    """query [1, heads, T, D], key/value [1, kv_heads, T, D] -> ([1, T, heads, D], None)."""
    meta: AttentionMetadata = paged_metadata
    if meta is None:
        raise RuntimeError("paged attention was called without paged_metadata: run the model through ModelRunner")
    kv = meta.kv_cache[module.layer_idx]
    k_cache, v_cache = kv[0], kv[1]  # [num_blocks, block_size, kv_heads, D]
    num_tokens, kv_heads, head_dim = query.shape[2], k_cache.shape[2], k_cache.shape[3]
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, kv_heads, D]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, new_k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, new_v.to(v_cache.dtype))

    out = query.new_empty(num_tokens, query.shape[1], head_dim)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(query, k_cache, v_cache, meta, scaling)
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill(query, new_k, new_v, k_cache, v_cache, chunk, scaling)
    return out.unsqueeze(0), None


def _decode(query, k_cache, v_cache, meta: AttentionMetadata, scaling) -> torch.Tensor:
    """One query per sequence, batched: gather each sequence's blocks, mask past its length. -> [B, heads, D]"""
    q = query[0, :, : meta.num_decodes].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, D]
    k = _gather(k_cache, meta.decode_block_tables)
    v = _gather(v_cache, meta.decode_block_tables)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_key_mask, scale=scaling, enable_gqa=True)
    return o[:, :, 0]


def _prefill(query, new_k, new_v, k_cache, v_cache, chunk: PrefillChunk, scaling) -> torch.Tensor:
    """A chunk of one sequence, causal over its cached context plus itself. -> [n, heads, D]"""
    q = query[:, :, chunk.start : chunk.end]  # [1, heads, n, D]
    num_new = chunk.end - chunk.start
    if chunk.context_len == num_new:  # nothing cached before: attend to the fresh K/V directly
        k = new_k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        v = new_v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        k = _gather(k_cache, chunk.block_table.unsqueeze(0))[:, :, : chunk.context_len]
        v = _gather(v_cache, chunk.block_table.unsqueeze(0))[:, :, : chunk.context_len]
        offset = chunk.context_len - num_new
        rows = torch.arange(num_new, device=q.device).unsqueeze(1) + offset
        mask = torch.arange(chunk.context_len, device=q.device).unsqueeze(0) <= rows
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return o[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, D] by [B, nb] -> [B, kv_heads, nb * block_size, D] (a strided view)."""
    batch, num_blocks = block_tables.shape
    blocks = cache[block_tables]  # [B, nb, block_size, kv_heads, D]
    return blocks.view(batch, num_blocks * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def no_mask(*args, **kwargs):
    """Causality and sequence boundaries come from AttentionMetadata, so transformers builds no mask."""
    return None


def register() -> str:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_mask)
    return ATTN_IMPLEMENTATION
