"""The C++ greedy pick (engine/csrc/greedy_cpu.cpp) of each ISA build, and of another source tree's kernels, timed
alternated in one process on fresh logits (a VM's speed drifts between processes more than these differ). Each
(tree, ISA) is its own module, so a tree at an older commit (a `git worktree`) runs beside this one.

python benchmarks/greedy_pick.py --isas native,avx2 --other /tmp/base --threads 1
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cpu_flags  # noqa: E402  the sibling script
from tree_kernels import alternated_medians, build_tree_kernels  # noqa: E402  the sibling script

CASES = [(1, torch.float32), (64, torch.bfloat16), (64, torch.float32)]  # rows of SmolLM2's 49,152 logits
cli = typer.Typer(add_completion=False)


def build(tree: Path, isa: str):
    return build_tree_kernels(tree, isa, ["greedy_or_invalid_cpu"]).greedy_or_invalid_cpu


def time_us(kernel, logits: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for x in logits:
        kernel(x, -1)
    return (time.perf_counter() - start) / len(logits) * 1e6


@cli.command()
def main(isas: str = "native,avx2", other: str = "", threads: int = 1, rounds: int = 30, out: str = ""):
    trees = [("this tree", ROOT)] + ([(other, Path(other))] if other else [])
    kernels = {(name, isa): build(tree, isa) for name, tree in tqdm(trees, desc="trees") for isa in isas.split(",")}
    torch.set_num_threads(threads)
    rows = []
    for count, dtype in tqdm(CASES, desc="cases"):
        logits = [torch.randn(count, 49152).to(dtype) for _ in range(4)]  # 4 buffers: none stays in L2
        timers = {key: lambda kernel=kernel: time_us(kernel, logits) for key, kernel in kernels.items()}
        medians = alternated_medians(timers, rounds, warm=3)
        rows += [dict(tree=k[0], isa=k[1], rows=count, dtype=str(dtype), us=us) for k, us in medians.items()]
    table = Table(title=f"greedy pick, {threads} thread(s), median of {rounds} alternated rounds")
    for column in ("tree", "isa", "rows", "dtype", "us a call"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["tree"], r["isa"], str(r["rows"]), r["dtype"], f"{r['us']:.1f}")
    Console().print(table)
    if out:
        Path(out).write_text(json.dumps(dict(cpu_flags=cpu_flags(), threads=threads, rows=rows), indent=1))


if __name__ == "__main__":
    cli()
