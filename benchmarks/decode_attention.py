"""The C++ decode-attention kernel alone, as the engine meets it: one cold KV pool per layer, each sequence's blocks
scattered at random, reported against the machine's read bandwidth (a sum over 1 GiB).

python benchmarks/decode_attention.py --batch 128 --context 200
"""
from __future__ import annotations

import time

import torch
import typer

from engine.cpu_kernels import build_paged_decode

cli = typer.Typer(add_completion=False)


def read_bandwidth_gbs(repeats: int = 5) -> float:
    x = torch.randn(256 * 1024 * 1024 // 4)
    x.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    return x.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9


@cli.command()
def main(batch: int = 128, context: int = 200, heads: int = 9, kv_heads: int = 3, head_dim: int = 64, block_size: int = 16,
         layers: int = 30, threads: int = 2, dtype: str = "bfloat16", repeats: int = 5):
    torch.set_num_threads(threads)
    op, dt = build_paged_decode(), getattr(torch, dtype)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq * 2
    g = torch.Generator().manual_seed(0)
    pools = [tuple(torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dt) for _ in range(2))
             for _ in range(layers)]
    tables = torch.randperm(num_blocks, generator=g)[: batch * per_seq].view(batch, per_seq)
    lens, q = torch.full((batch,), context), torch.randn(batch, heads, head_dim, generator=g).to(dt)
    sweep = lambda: [op(q, k, v, tables, lens, head_dim**-0.5) for k, v in pools]  # noqa: E731
    sweep()
    start = time.perf_counter()
    for _ in range(repeats):
        sweep()
    ms = (time.perf_counter() - start) / repeats * 1e3
    kv_bytes = batch * context * kv_heads * head_dim * 2 * dt.itemsize * layers
    print(f"{layers} layers, batch {batch}, context {context}, {dtype}, {threads} threads: {ms:.1f} ms, "
          f"{kv_bytes / ms / 1e6:.1f} GB/s of KV read; machine read bandwidth {read_bandwidth_gbs():.1f} GB/s")


if __name__ == "__main__":
    cli()
