"""Paged attention for CUDA in Triton, one concept a file: the KV write, decode (GQA, split-K) and chunked prefill
over the flat batch. Each reads the head-major pool `[kv_heads, num_blocks, block_size, head_dim]` in place (no
gather, no padding to the longest context). Every machine checks them: under `TRITON_INTERPRET=1` on CPU tensors,
and compiled for sm_80/89/90 without a GPU (`tests/engine/kernels/`). The GPU machine has triton 3.6: keep to
language features that it and 3.9 share."""
