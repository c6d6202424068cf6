"""The engine alone on the load-test prompt mix, closed loop: what serving could reach without Ray, HTTP or Locust.

python benchmarks/closed_loop.py --threads 1 --concurrency 48 --seconds 40
"""
from __future__ import annotations

import itertools
import random
import time

import typer
from tqdm.auto import tqdm

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.step_stats import GC_COLLECTIONS_KEY, GC_PAUSE_KEY, GENERATIONS, PHASE_KEY, PHASES
from loadtest.prompts import load_prompts

cli = typer.Typer(add_completion=False)


class ClosedLoop:
    """`users` seeded requests of the load-test mix in flight; each one that finishes is replaced by the next."""

    def __init__(self, threads: int = 1, users: int = 48, temperature: float = 1.0, max_tokens: int = 128):
        self.engine = LLMEngine(EngineConfig(max_num_seqs=128, max_num_batched_tokens=1024, num_threads=threads))  # as config.yaml
        self.temperature, self.max_tokens = temperature, max_tokens
        self._prompts, self._rng, self._ids = load_prompts(), random.Random(0), itertools.count()
        for _ in range(users):
            self._add()

    def _add(self) -> None:
        i = next(self._ids)
        params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=i)
        self.engine.add_request(f"r{i}", self._rng.choice(self._prompts).messages, params)

    def step(self) -> int:
        """One engine step; returns how many requests finished (and were replaced)."""
        finished = [out for out in self.engine.step() if out.finished]
        for _ in finished:
            self._add()
        return len(finished)


@cli.command()
def main(threads: int = 1, concurrency: int = 48, seconds: float = 40, temperature: float = 1.0, max_tokens: int = 128):
    loop = ClosedLoop(threads, concurrency, temperature, max_tokens)
    engine = loop.engine
    start, steps, done = time.perf_counter(), 0, 0
    with tqdm(total=int(seconds), desc="closed loop", unit="s") as bar:
        while (elapsed := time.perf_counter() - start) < seconds:
            done += loop.step()
            steps += 1
            bar.n = int(elapsed)
            bar.refresh()
    stats = engine.stats()
    print(f"threads {threads}, temperature {temperature}: {stats['generation_tokens'] / elapsed:.0f} generated tok/s, "
          f"{steps / elapsed:.2f} steps/s, {done / elapsed * 3600:,.0f} req/h, "
          f"{(stats['prompt_tokens'] + stats['generation_tokens']) / steps:.0f} tokens/step")
    phases = {phase: stats[PHASE_KEY.format(phase)] for phase in PHASES}
    gc_seconds = sum(stats[GC_PAUSE_KEY.format(g)] for g in GENERATIONS)
    print("step time by phase: " + ", ".join(f"{phase} {seconds / elapsed:.1%}" for phase, seconds in phases.items())
          + f"; GC pauses {gc_seconds / elapsed:.2%} ({stats[GC_COLLECTIONS_KEY.format(2)]} full collections); "
          f"resident {stats['resident_bytes'] / 2**20:,.0f} MiB")


if __name__ == "__main__":
    cli()
