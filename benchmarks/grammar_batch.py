"""What one grammar-constrained row costs its batch-mates in the sampler: a batch of greedy rows with 0 or 1 rows
under a grammar mask, against every row worked on the float path (what the sampler did before it split rows).

    python benchmarks/grammar_batch.py [--rows 64] [--vocab 49152] [--dtype bfloat16] [--device cpu]
"""
from __future__ import annotations

import statistics
import time

import torch
import typer
from rich.console import Console
from rich.table import Table

from engine.sampler import GrammarMask, Sampler
from engine.sampling_params import SamplingParams


def median_ms(run, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def main(rows: int = 64, vocab: int = 49152, dtype: str = "bfloat16", device: str = "cpu", repeats: int = 30):
    logits = torch.randn(rows, vocab, dtype=getattr(torch, dtype), device=device)
    params = [SamplingParams(temperature=0.0)] * rows
    sampler, none = Sampler(), [None] * rows
    one_row = GrammarMask([0], torch.ones(1, vocab, dtype=torch.bool, device=device))
    every_row = GrammarMask(list(range(rows)), torch.ones(rows, vocab, dtype=torch.bool, device=device))
    cases = {
        "greedy rows only": lambda: sampler(logits, params, none, [[]] * rows),
        "one row under a grammar": lambda: sampler(logits, params, none, [[]] * rows, grammar=one_row),
        "every row on the float path (before)": lambda: sampler(logits, params, none, [[]] * rows, grammar=every_row),
    }
    table = Table(title=f"sampler, {rows} greedy rows, vocab {vocab}, {dtype} on {device}: median of {repeats}")
    table.add_column("batch")
    table.add_column("ms", justify="right")
    for name, run in cases.items():
        table.add_row(name, f"{median_ms(run, repeats, device):.2f}")
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
