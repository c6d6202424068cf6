"""Median engine step and sampler time on a seeded 48-user closed loop of the load-test mix: an A/B tool for engine
changes, where the whole-run req/h figures are too noisy to see 10%.

python benchmarks/step_time.py --threads 1
"""
from __future__ import annotations

import itertools
import random
import statistics
import time

import torch
import typer
from tqdm.auto import trange

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.sampler import Sampler, make_generator
from loadtest.prompts import load_prompts

cli = typer.Typer(add_completion=False)


@cli.command()
def main(threads: int = 1, users: int = 48, warmup_steps: int = 50, steps: int = 200):
    engine = LLMEngine(EngineConfig(max_num_seqs=128, max_num_batched_tokens=1024, num_threads=threads))  # as config.yaml
    prompts, rng, ids = load_prompts(), random.Random(0), itertools.count()

    def add() -> None:
        i = next(ids)
        engine.add_request(f"r{i}", rng.choice(prompts).messages, SamplingParams(max_tokens=128, temperature=1.0, seed=i))

    for _ in range(users):
        add()
    times = []
    for step in trange(warmup_steps + steps, desc="steps"):
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                add()
        if step >= warmup_steps:
            times.append(time.perf_counter() - start)
    stats = engine.stats()
    tokens = (stats["prompt_tokens"] + stats["generation_tokens"]) / (warmup_steps + steps)
    print(f"threads {threads}: median step {statistics.median(times) * 1e3:.1f} ms, {tokens:.0f} tokens/step")
    print(f"sampler, {users} rows x {engine.vocab_size} vocab: median {sampler_ms(users, engine.vocab_size):.1f} ms")


def sampler_ms(rows: int, vocab: int, repeats: int = 30) -> float:
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(rows)]
    generators = [make_generator(p, logits.device) for p in params]
    sampler, times = Sampler(), []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, params, generators, [[]] * rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    cli()
