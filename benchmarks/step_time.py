"""Median engine step and sampler time on a seeded 48-user closed loop of the load-test mix: an A/B tool for engine
changes, where the whole-run req/h figures are too noisy to see 10%.

python benchmarks/step_time.py --threads 1
"""
from __future__ import annotations

import statistics
import time

import torch
import typer
from tqdm.auto import trange

from closed_loop import ClosedLoop  # the sibling script; run as python benchmarks/step_time.py
from engine import SamplingParams
from engine.sampler import Sampler, make_generator

cli = typer.Typer(add_completion=False)


@cli.command()
def main(threads: int = 1, users: int = 48, warmup_steps: int = 50, steps: int = 200):
    loop = ClosedLoop(threads, users)
    engine, times = loop.engine, []
    for step in trange(warmup_steps + steps, desc="steps"):
        start = time.perf_counter()
        loop.step()
        if step >= warmup_steps:
            times.append(time.perf_counter() - start)
    stats = engine.stats()
    tokens = (stats.prompt_tokens + stats.generation_tokens) / (warmup_steps + steps)
    print(f"threads {threads}: median step {statistics.median(times) * 1e3:.1f} ms, {tokens:.0f} tokens/step")
    print(f"sampler, {users} rows x {engine.vocab_size} vocab: median {sampler_ms(users, engine.vocab_size):.1f} ms")


def sampler_ms(rows: int, vocab: int, repeats: int = 30) -> float:
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(rows)]
    generators = [make_generator(p) for p in params]
    sampler, times = Sampler(), []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, params, generators, [[]] * rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    cli()
