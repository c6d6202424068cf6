"""The C++ decode-attention kernel alone, as the engine meets it: one cold KV pool for all layers on 2 MB pages (as
the engine asks for its pool), each sequence's blocks scattered at random, timed against what this layout allows:
the machine's read bandwidth (a sum over 1 GiB, one stream per thread), and the same K and V rows walked with no arithmetic in
the kernel's order (K rows, then V rows: two passes) and with K and V of a key together (one pass), with the
kernel's prefetch (`kv_walk.cpp`). The kernel, the walks and the sum alternate, medians of the rounds.

python benchmarks/decode_attention.py --batch 64 --context 200 --out benchmarks/results/decode-attention.json
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cpu_flags  # noqa: E402  the sibling script
from engine.cpu_kernels import CFLAGS, LDFLAGS, build_paged_decode, cpu_features_tag  # noqa: E402
from engine.host_memory import ask_huge_pages  # noqa: E402

cli = typer.Typer(add_completion=False)


def kv_walk():
    from engine.extension_build import load_inline_locked

    return load_inline_locked(name=f"benchmark_kv_walk_{cpu_features_tag()}",  # -march=native: one build per CPU
                              cpp_sources=[(Path(__file__).parent / "kv_walk.cpp").read_text()], functions=["kv_walk"],
                              extra_cflags=[*CFLAGS, f"-I{ROOT / 'engine' / 'csrc'}"], extra_ldflags=list(LDFLAGS),
                              no_implicit_headers=True).kv_walk  # the engine's lean headers: a cold build 31 -> 13 s


def huge_page_tensor(shape, dtype) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype)
    ask_huge_pages(tensor)  # before the first touch, or the pages are 4 KB
    return tensor


@cli.command()
def main(batch: int = 64, context: int = 200, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
         block_size: int = 16, layers: int = 30, threads: int = 2, dtype: str = "bfloat16", rounds: int = 7,
         stream_mib: int = 1024, out: Path | None = None):
    """SmolLM2-135M's attention shape by default (9 query heads on 3 KV heads of 64)."""
    torch.set_num_threads(threads)
    op, walk, dt = build_paged_decode(), kv_walk(), getattr(torch, dtype)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq * 2
    generator = torch.Generator().manual_seed(0)
    pool = huge_page_tensor((layers, 2, kv_heads, num_blocks, block_size, head_dim), dt)
    pool.normal_(generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[: batch * per_seq].view(batch, per_seq)
    lens, q = torch.full((batch,), context), torch.randn(batch, heads, head_dim, generator=generator).to(dt)
    stream = huge_page_tensor((stream_mib << 18,), torch.float32).fill_(1.0)
    cases = {
        "kernel": lambda: [op(q, pool[i, 0], pool[i, 1], tables, lens, head_dim**-0.5) for i in range(layers)],
        "walk, two passes": lambda: [walk(pool[i, 0], pool[i, 1], tables, lens, False) for i in range(layers)],
        "walk, one pass": lambda: [walk(pool[i, 0], pool[i, 1], tables, lens, True) for i in range(layers)],
        "one stream (sum)": lambda: stream.sum(),
    }
    assert cases["walk, two passes"]() == cases["walk, one pass"](), "the walks read different rows"
    timings: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds + 1):  # the first round warms up
        for name, run in cases.items():
            started = time.perf_counter()
            run()
            timings[name].append(time.perf_counter() - started)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * dt.itemsize * layers
    moved = {name: stream.numel() * 4 if name.startswith("one stream") else kv_bytes for name in cases}
    medians = {name: statistics.median(ts[1:]) for name, ts in timings.items()}
    rows = [{"case": name, "ms": float(f"{1e3 * s:.3g}"), "gb_s": float(f"{moved[name] / s / 1e9:.3g}")}
            for name, s in medians.items()]
    table = Table(title=f"decode attention, {layers} layers, batch {batch}, context {context}, {dtype}, "
                        f"{threads} threads (median of {rounds})")
    for column in ("case", "ms", "GB/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["case"], str(row["ms"]), str(row["gb_s"]))
    Console(width=100).print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        settings = dict(batch=batch, context=context, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        block_size=block_size, layers=layers, threads=threads, dtype=dtype, rounds=rounds)
        out.write_text(json.dumps({"cpu": cpu_flags(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                   "settings": settings, "rows": rows}, indent=2))


if __name__ == "__main__":
    cli()
