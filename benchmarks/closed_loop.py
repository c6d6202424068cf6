"""The engine alone on the load-test prompt mix, closed loop: what serving could reach without Ray, HTTP or Locust.

python benchmarks/closed_loop.py --concurrency 48 --seconds 600 --warmup 60   # as make loadtest
"""
from __future__ import annotations

import itertools
import random
import time

import typer
from tqdm.auto import tqdm

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from core_env import restart_as_served  # the sibling script
from loadtest.prompts import load_prompts
from serve_app.config import shipped_app_args

cli = typer.Typer(add_completion=False)


def served_engine_config(**overrides) -> EngineConfig:
    """The engine exactly as `make serve` configures it (serve_app/config.yaml, parsed as the app parses it), in this
    process."""
    engine = shipped_app_args().engine_config
    return engine.model_copy(update={"engine_process": False, **overrides})


class ClosedLoop:
    """`users` seeded requests of the load-test mix in flight; each one that finishes is replaced by the next."""

    def __init__(self, threads: int | None = None, users: int = 48, temperature: float = 1.0, max_tokens: int = 128,
                 dtype: str | None = None):
        overrides = ({"num_threads": threads} if threads else {}) | ({"dtype": dtype} if dtype else {})
        self.llm = LLM(config=served_engine_config(**overrides))
        self.engine = self.llm.engine
        self.temperature, self.max_tokens = temperature, max_tokens
        self._prompts, self._rng, self._ids = load_prompts(), random.Random(0), itertools.count()
        for _ in range(users):
            self._add()

    def _add(self) -> None:
        i = next(self._ids)
        params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=i)
        self.llm.add_request(f"r{i}", self._rng.choice(self._prompts).messages, params)

    def step(self) -> int:
        """One engine step; returns how many requests finished (and were replaced)."""
        finished = [out for out in self.llm.step() if out.finished]
        for _ in finished:
            self._add()
        return len(finished)


@cli.command()
def main(threads: int = typer.Option(0, help="torch threads; 0: as serve_app/config.yaml sets them"),
         concurrency: int = 48, seconds: float = 40, temperature: float = 1.0, max_tokens: int = 128,
         dtype: str = typer.Option("", help="the engine's dtype; empty: as serve_app/config.yaml sets it"),
         warmup: float = typer.Option(0, help="seconds left out of the rates, as `make loadtest --warmup` does")):
    if warmup >= seconds:
        raise typer.BadParameter(f"--warmup {warmup:g} leaves nothing of --seconds {seconds:g} to measure")
    loop = ClosedLoop(threads, concurrency, temperature, max_tokens, dtype or None)
    engine = loop.engine
    start, steps, done = time.perf_counter(), 0, 0
    at_warmup = None  # (time, steps, done, generated tokens) when the measured window opens
    with tqdm(total=int(seconds), desc="closed loop", unit="s") as bar:
        while (elapsed := time.perf_counter() - start) < seconds:
            if at_warmup is None and elapsed >= warmup:
                at_warmup = (elapsed, steps, done, engine.stats().generation_tokens)
            done += loop.step()
            steps += 1
            if int(elapsed) > bar.n:
                bar.update(int(elapsed) - bar.n)
    stats = engine.stats()
    window = elapsed - at_warmup[0]
    dtype_name = str(engine.dtype).removeprefix("torch.")
    print(f"threads {engine.config.resolved_num_threads()}, {dtype_name}, temperature {temperature}, "
          f"{window:.0f} s after {at_warmup[0]:.0f} s of warm-up: "
          f"{(stats.generation_tokens - at_warmup[3]) / window:.0f} generated tok/s, "
          f"{(steps - at_warmup[1]) / window:.2f} steps/s, {(done - at_warmup[2]) / window * 3600:,.0f} req/h, "
          f"{(stats.prompt_tokens + stats.generation_tokens) / steps:.0f} tokens/step")
    gc_seconds = sum(stats.gc_pause_seconds.values())
    print("step time by phase: " + ", ".join(f"{phase} {seconds / elapsed:.1%}" for phase, seconds in stats.step_seconds.items())
          + f"; GC pauses {gc_seconds / elapsed:.2%} ({stats.gc_collections[2]} full collections); "
          f"resident {stats.resident_bytes / 2**20:,.0f} MiB")


if __name__ == "__main__":
    restart_as_served()
    cli()
