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
from loadtest.prompts import load_prompts

cli = typer.Typer(add_completion=False)


@cli.command()
def main(threads: int = 1, concurrency: int = 48, seconds: float = 40, temperature: float = 1.0, max_tokens: int = 128):
    engine = LLMEngine(EngineConfig(max_num_seqs=128, max_num_batched_tokens=1024, num_threads=threads))  # as config.yaml
    prompts, rng, ids = load_prompts(), random.Random(0), itertools.count()

    def add() -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        engine.add_request(f"r{next(ids)}", rng.choice(prompts).messages, params)

    for _ in range(concurrency):
        add()
    start, steps, done = time.perf_counter(), 0, 0
    with tqdm(total=int(seconds), desc="closed loop", unit="s") as bar:
        while (elapsed := time.perf_counter() - start) < seconds:
            for out in engine.step():
                if out.finished:
                    done += 1
                    add()  # the next request of this "user"
            steps += 1
            bar.n = int(elapsed)
            bar.refresh()
    stats = engine.stats()
    print(f"threads {threads}, temperature {temperature}: {stats['generation_tokens'] / elapsed:.0f} generated tok/s, "
          f"{steps / elapsed:.2f} steps/s, {done / elapsed * 3600:,.0f} req/h, "
          f"{(stats['prompt_tokens'] + stats['generation_tokens']) / steps:.0f} tokens/step")


if __name__ == "__main__":
    cli()
