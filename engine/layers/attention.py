"""Paged attention over a flat, unpadded batch: each layer writes its new K/V into their pool slots, then every
sequence attends over its own context read back from the pool through its block table.

The pool is head-major, `[layers, 2, kv_heads, num_blocks, block_size, head_dim]`: gathering a batch's blocks
then yields contiguous `[kv_heads, batch, context, head_dim]` tensors, on which batched matmuls are fast.
A block-major pool with SDPA on the strided gather measured 5x slower on CPU (BENCHMARKS.md).
The native models call `paged_attention` directly; `engine/models/hf.py` adapts it to transformers' interface.
A compiled decoder holds it as one custom op instead (`engine/layers/attention_op.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F

from engine.layers.kv_cache_dtype import as_stored, is_fp8, raw


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    end: int
    context_len: int  # tokens in the sequence once this chunk is written
    block_table: torch.Tensor  # [num_blocks] long


@dataclass
class DecodeBatch:
    """Single-token sequences, first in the flat batch, attended to together."""

    block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    context_lens: torch.Tensor  # [num_decodes]
    block_size: int
    kernel: Callable | None = None  # a fused paged-decode op (engine.cpu_kernels); None: the torch path
    num_splits: int = 1  # the Triton kernel's parts per sequence (flash-decoding); 1 where the batch fills the GPU

    @property
    def size(self) -> int:
        return self.context_lens.shape[0]

    @cached_property
    def key_bias(self) -> torch.Tensor:
        """[num_decodes, max_blocks * block_size] float32: 0 where attended, -inf past each sequence's end."""
        positions = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.context_lens.device)
        past_end = positions.unsqueeze(0) >= self.context_lens.unsqueeze(1)
        return torch.zeros(past_end.shape, device=past_end.device).masked_fill_(past_end, float("-inf"))

    def windowed_key_bias(self, window: int) -> torch.Tensor:
        """key_bias that also masks every key more than `window - 1` positions before the query (transformers'
        sliding window: a query attends to itself and the `window - 1` keys before it)."""
        biases = self.__dict__.setdefault("_windowed_biases", {})
        if window not in biases:
            positions = torch.arange(self.key_bias.shape[1], device=self.context_lens.device)
            before = positions.unsqueeze(0) < (self.context_lens - window).unsqueeze(1)
            biases[window] = self.key_bias.masked_fill(before, float("-inf"))
        return biases[window]

    @cached_property
    def gather_buffers(self) -> dict[str, torch.Tensor]:
        """Workspace for the gathered K and V, allocated on first use in a step and reused by every layer."""
        return {}


@dataclass
class PrefillBatch:
    """The step's prefill chunks as tensors, for a kernel that attends all of them in one call (Triton)."""

    query_starts: torch.Tensor  # [S + 1]: chunk i is rows query_starts[i]:query_starts[i + 1] after the decodes
    context_lens: torch.Tensor  # [S]: tokens in each sequence once its chunk is written
    block_tables: torch.Tensor  # [S, width], padded with block 0
    max_query_len: int


@dataclass
class AttentionMetadata:
    """What one step's attention needs to know, built once per step by the model runner."""

    kv_layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V pools [kv_heads, num_blocks, block_size, D]
    slot_mapping: torch.Tensor  # [num_tokens]: pool slot (block * block_size + offset) of each new token
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    write_kv: Callable | None = None  # the fused CPU op writing new K/V into their slots; None: index_copy_
    kv_pool: torch.Tensor | None = None  # the pool kv_layers are views of, [layers, 2, kv_heads, blocks, block_size, D]
    prefill_batch: PrefillBatch | None = None  # set where the Triton kernels run: then they do all of a layer
    triton: bool = False
    prefill_kernel: Callable | None = None  # the bf16 CPU prefill op (engine.cpu_kernels); None: SDPA

    @cached_property
    def prefill_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunks as the CPU prefill kernel takes them, made once a step: block tables [S, width] (padded with
        block 0), query starts [S + 1] from the first chunk's row, context lengths [S]."""
        tables = torch.nn.utils.rnn.pad_sequence([chunk.block_table for chunk in self.prefills], batch_first=True)
        first = self.prefills[0].start
        starts = torch.tensor([first] + [chunk.end for chunk in self.prefills]) - first
        return tables, starts, torch.tensor([chunk.context_len for chunk in self.prefills])

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
               shape: ScoreShape | None = None) -> torch.Tensor:
        k_cache, v_cache = self.kv_layers[layer]
        if shape is not None and (self.decode_kernel_set or self.prefill_kernel is not None):
            raise RuntimeError(f"this layer's attention has {shape}, which the C++ kernels do not compute")
        if self.triton:
            from engine.layers.triton_attention import attend_triton  # triton is imported only where it runs
            return attend_triton(query, key, value, k_cache, v_cache, self, scaling, shape)
        return attend(query, key, value, k_cache, v_cache, self, scaling, shape)

    @property
    def decode_kernel_set(self) -> bool:
        return self.decode is not None and self.decode.kernel is not None


@dataclass(frozen=True)
class ScoreShape:
    """What some models do to attention scores beyond the causal mask, which transformers' code passes per layer
    (engine/models/hf.py): a sliding window of `window` keys (the query's own among them), and `softcap` * tanh(score
    / softcap) before the mask (Gemma 2's logit soft-capping)."""

    window: int | None = None
    softcap: float | None = None

    @classmethod
    def of(cls, window: int | None, softcap: float | None) -> ScoreShape | None:
        return None if window is None and softcap is None else cls(window, softcap)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, meta, scaling: float,
                    shape: ScoreShape | None = None) -> torch.Tensor:
    """query [T, heads, D], key/value [T, kv_heads, D] of one layer -> [T, heads, D]; key/value None on the Triton
    backend where the rotary kernel has written them into the pool. `meta`: the step's AttentionMetadata, or inside a
    compiled graph its tensors (`attention_op.AttentionTensors`)."""
    if shape is None:
        return meta.attend(query, key, value, layer, scaling)
    return meta.attend(query, key, value, layer, scaling, shape)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scaling: float, shape: ScoreShape | None = None) -> torch.Tensor:
    """Write one layer's new K/V into its pools, then attend each sequence over its context."""
    if meta.write_kv is not None and (key.dtype == k_cache.dtype or is_fp8(k_cache.dtype)):
        meta.write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
    else:
        kv_heads, _, _, head_dim = k_cache.shape
        for cache, new in ((k_cache, key), (v_cache, value)):
            stored = raw(as_stored(new.transpose(0, 1), cache.dtype))
            raw(cache).view(kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, stored)
    if not meta.prefills:  # decodes only: the kernel's output is the whole answer
        return _decode(query, k_cache, v_cache, meta.decode, scaling, shape)
    out = query.new_empty(query.shape)
    if meta.decode is not None:
        out[: meta.decode.size] = _decode(query[: meta.decode.size], k_cache, v_cache, meta.decode, scaling, shape)
    if meta.prefill_kernel is not None:  # every chunk in one call
        first = meta.prefills[0].start
        out[first:] = _prefill_kernel(meta.prefill_kernel, query[first:], k_cache, v_cache, meta.prefill_tensors, scaling)
        return out
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill(query, key, value, k_cache, v_cache, chunk, scaling, shape)
    return out


def _decode(query, k_cache, v_cache, decode: DecodeBatch, scaling: float, shape: ScoreShape | None = None
            ) -> torch.Tensor:
    """query [B, heads, D] -> [B, heads, D]."""
    if decode.kernel is not None:
        return decode.kernel(query, k_cache, v_cache, decode.block_tables, decode.context_lens, scaling)
    return _decode_torch(query.transpose(0, 1), k_cache, v_cache, decode, scaling, shape)


def _decode_torch(query, k_cache, v_cache, decode: DecodeBatch, scaling: float, shape: ScoreShape | None = None
                  ) -> torch.Tensor:
    """Gather each sequence's blocks, padded to the longest; query heads of one KV head share its keys (GQA)."""
    kv_heads, _, block_size, head_dim = k_cache.shape
    heads, batch = query.shape[0], query.shape[1]
    context = decode.key_bias.shape[1]
    block_ids = decode.block_tables.flatten()
    buffers = decode.gather_buffers
    if not buffers:
        gathered = (kv_heads, len(block_ids), block_size * head_dim)
        buffers.update(k=k_cache.new_empty(gathered), v=v_cache.new_empty(gathered))
    k = _gather(k_cache, block_ids, buffers["k"]).view(kv_heads, batch, context, head_dim).to(query.dtype)
    v = _gather(v_cache, block_ids, buffers["v"]).view(kv_heads, batch, context, head_dim).to(query.dtype)
    q = query.reshape(kv_heads, heads // kv_heads, batch, head_dim).transpose(1, 2).contiguous()  # [kvh, B, g, D]
    bias = decode.key_bias if shape is None or shape.window is None else decode.windowed_key_bias(shape.window)
    scores = _capped(torch.matmul(q, k.transpose(-1, -2)).float().mul_(scaling), shape).add_(bias[None, :, None, :])
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [kvh, B, g, D]
    return out.transpose(0, 1).reshape(batch, heads, head_dim)


def _prefill(query, key, value, k_cache, v_cache, chunk: PrefillChunk, scaling: float,
             shape: ScoreShape | None = None) -> torch.Tensor:
    """A chunk of one sequence, causal over its cached context plus itself. -> [n, heads, D]"""
    q = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
    num_new = chunk.end - chunk.start
    # nothing cached before: attend to the fresh K/V directly. Not from an fp8 cache, whose rounded K/V every later
    # chunk and prefix hit reads: a prompt's output must not depend on whether its prefix was cached
    if chunk.context_len == num_new and not is_fp8(k_cache.dtype):
        k = key[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        v = value[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        if shape is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)[0].transpose(0, 1)
    else:
        k = _gather(k_cache, chunk.block_table)[:, : chunk.context_len].unsqueeze(0).to(q.dtype)
        v = _gather(v_cache, chunk.block_table)[:, : chunk.context_len].unsqueeze(0).to(q.dtype)
    rows = torch.arange(chunk.context_len - num_new, chunk.context_len, device=q.device).unsqueeze(1)
    keys = torch.arange(chunk.context_len, device=q.device).unsqueeze(0)
    mask = keys <= rows
    if shape is not None and shape.window is not None:
        mask &= keys > rows - shape.window
    if shape is None or shape.softcap is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    else:  # SDPA has no soft-capping: the scores in fp32, as transformers' eager attention computes them
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = _capped(torch.matmul(q, k.transpose(-1, -2)).float().mul_(scaling), shape)
        probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1).to(v.dtype)
        o = torch.matmul(probs, v)
    return o[0].transpose(0, 1)


def _capped(scores: torch.Tensor, shape: ScoreShape | None) -> torch.Tensor:
    """fp32 scores, soft-capped in place where the layer asks (softcap * tanh(scores / softcap))."""
    if shape is None or shape.softcap is None:
        return scores
    return scores.div_(shape.softcap).tanh_().mul_(shape.softcap)


def _prefill_kernel(kernel: Callable, q, k_cache, v_cache, chunks: tuple[torch.Tensor, ...], scaling: float
                    ) -> torch.Tensor:
    """The step's chunks (`q`: their rows) from the pool, where their K/V were just written. The kernel takes rows of
    [heads, D] at any stride (the fused QKV's); transformers' layout is copied into that first."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    return kernel(q, k_cache, v_cache, *chunks, scaling)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[kv_heads, num_blocks, block_size, D] by [n] block ids -> contiguous [kv_heads, n * block_size, D]."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    flat = raw(cache).view(kv_heads, num_blocks, block_size * head_dim)
    gathered = flat.index_select(1, block_ids) if out is None else torch.index_select(flat, 1, block_ids, out=raw(out))
    return gathered.view(cache.dtype).view(kv_heads, -1, head_dim)
