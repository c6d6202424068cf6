"""Paged attention as a `torch.library` custom op, so a compiled decoder (`engine/models/compiled.py`) holds it as
one node of its graph instead of breaking around it (vLLM's compiled models do the same with their attention).

An op takes tensors and scalars only: `AttentionTensors` carries one step's metadata as flat tensors, and the op
rebuilds `AttentionMetadata` inside and runs the eager `attend` on it, kernels included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cpu_kernels import build_fused_ops, build_paged_decode, paged_prefill_op
from engine.layers.attention import AttentionMetadata, DecodeBatch, PrefillChunk, attend


@dataclass
class AttentionTensors:
    """One step's attention inputs, tensors only: what a compiled graph may take. Duck-types AttentionMetadata's
    `attend`, so the layers call it the same way."""

    kv_pool: torch.Tensor  # [layers, 2, kv_heads, blocks, block_size, D]
    slot_mapping: torch.Tensor  # [T]
    decode_tables: torch.Tensor  # [num_decodes, width] (num_decodes may be 0)
    decode_lens: torch.Tensor  # [num_decodes]
    prefill_spans: torch.Tensor  # [num_chunks, 3]: start, end, context_len
    prefill_tables: torch.Tensor  # [num_chunks, width], padded with block 0
    kernels: bool  # the C++ decode kernel and KV write (built where the engine chose them)

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "AttentionTensors":
        device = meta.slot_mapping.device
        empty = torch.zeros((0, 1), dtype=torch.long, device=device)
        decode_tables = meta.decode.block_tables if meta.decode is not None else empty
        decode_lens = meta.decode.context_lens if meta.decode is not None else empty[:, 0]
        width = max((len(chunk.block_table) for chunk in meta.prefills), default=1)
        tables = torch.zeros((len(meta.prefills), width), dtype=torch.long, device=device)
        for row, chunk in zip(tables, meta.prefills):
            row[: len(chunk.block_table)] = chunk.block_table
        spans = torch.tensor([[c.start, c.end, c.context_len] for c in meta.prefills], dtype=torch.long).view(-1, 3)
        return cls(meta.kv_pool, meta.slot_mapping, decode_tables, decode_lens, spans.to(device), tables,
                   meta.write_kv is not None)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float) -> torch.Tensor:
        return torch.ops.engine.paged_attention(
            query, key, value, self.kv_pool, layer, self.slot_mapping, self.decode_tables,
            self.decode_lens, self.prefill_spans, self.prefill_tables, scaling, self.kernels)


# Defined with `torch.library.define`, not `custom_op`: custom_op's Python wrappers (argument defaults, version
# bumps of mutated inputs) cost about 50 us a call, 30 times a step. The whole pool goes in and each layer's views
# are taken inside: given views of it as arguments, inductor 2.13 (dynamic shapes) passed every layer's K and V as
# the same view at offset 0.
torch.library.define(
    "engine::paged_attention",
    "(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_pool, int layer, Tensor slot_mapping, "
    "Tensor decode_tables, Tensor decode_lens, Tensor prefill_spans, Tensor prefill_tables, float scaling, "
    "bool kernels) -> Tensor")


@torch.library.impl("engine::paged_attention", "CompositeExplicitAutograd")
def paged_attention_op(query, key, value, kv_pool, layer, slot_mapping, decode_tables, decode_lens, prefill_spans,
                       prefill_tables, scaling, kernels):
    k_cache, v_cache = kv_pool[layer]
    block_size = k_cache.shape[2]
    decode = None
    if decode_tables.shape[0]:
        decode = DecodeBatch(decode_tables, decode_lens, block_size, build_paged_decode() if kernels else None)
    prefills = [PrefillChunk(start, end, context_len, table[: -(-context_len // block_size)])
                for (start, end, context_len), table in zip(prefill_spans.tolist(), prefill_tables)]
    meta = AttentionMetadata([], slot_mapping, decode, prefills, build_fused_ops().write_kv if kernels else None,
                             prefill_kernel=paged_prefill_op(query.dtype, query.shape[-1], block_size, k_cache.dtype)
                             if kernels else None)
    return attend(query, key, value, k_cache, v_cache, meta, scaling)


@torch.library.register_fake("engine::paged_attention")
def _(query, key, value, kv_pool, layer, slot_mapping, decode_tables, decode_lens, prefill_spans, prefill_tables,
      scaling, kernels):
    return torch.empty_like(query)
