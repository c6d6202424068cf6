"""One layer's paged attention on the Triton kernels (`engine/kernels/triton/`): the KV write, then decodes and
prefill chunks each in one call over the flat batch, reading the pool in place. The backend on CUDA; on CPU it runs
only under `TRITON_INTERPRET=1`, which is how the tests check it against the torch path."""
from __future__ import annotations

import torch

from engine.kernels.triton.decode import decode_attention
from engine.kernels.triton.kv_write import write_kv
from engine.kernels.triton.prefill import prefill_attention


def attend_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta, scaling: float, shape=None) -> torch.Tensor:
    """query [T, heads, D], key/value [T, kv_heads, D]: decodes first, then the prefill chunks -> [T, heads, D].
    `shape`: the layer's ScoreShape (a sliding window, soft-capping), if any. key/value None: the step's K/V are in
    the pool already (the rotary kernel wrote them, `TritonFusedOps.rotary_write_kv`)."""
    if key is not None:
        write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    num_decodes = 0
    if meta.decode is not None:
        decode = meta.decode
        num_decodes = decode.size
        decode_attention(query[:num_decodes], k_cache, v_cache, decode.block_tables, decode.context_lens, scaling,
                         decode.num_splits, out[:num_decodes], shape)
    if meta.prefill_batch is not None:
        chunks = meta.prefill_batch
        prefill_attention(query[num_decodes:], k_cache, v_cache, chunks.block_tables, chunks.query_starts,
                          chunks.context_lens, chunks.max_query_len, scaling, out[num_decodes:], shape)
    return out
