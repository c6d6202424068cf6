"""Long prompts beside a decoding stream: the stream's longest wait for a token while they prefill, and their time to
first token, with `long_prefill_token_threshold` off and on, in one run. The engine as served (its core in its own
process, the CPU config's step budget), without Ray or HTTP, so only the scheduling differs.

python benchmarks/long_prompt_stall.py --dtype float32 --thresholds none,256,128 --runs 3
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time

import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from engine import AsyncLLMEngine, SamplingParams

cli = typer.Typer(add_completion=False)


async def one_run(engine: AsyncLLMEngine, run: int, long_prompts: int, prompt_tokens: int) -> dict:
    stamps: list[float] = []

    async def stream() -> None:
        params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate("Tell me a long story about a lighthouse.", params, f"stream-{run}"):
            stamps.append(time.perf_counter())

    async def long(i: int) -> float:
        rng = random.Random(1000 * run + i)  # new ids every time: nothing comes from the prefix cache
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_tokens)]
        start = time.perf_counter()
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), f"long-{run}-{i}"):
            break
        return time.perf_counter() - start

    streaming = asyncio.create_task(stream())
    while len(stamps) < 8:  # decoding steadily
        await asyncio.sleep(0.01)
    opened = time.perf_counter()
    ttfts = await asyncio.gather(*(long(i) for i in range(long_prompts)))
    closed = time.perf_counter()
    await asyncio.sleep(0.5)
    streaming.cancel()
    window = [t for t in stamps if opened <= t <= closed + 0.5]
    before = [b - a for a, b in zip(stamps, stamps[1:]) if b < opened]
    gaps = [b - a for a, b in zip(window, window[1:])]
    return {"max_gap": max(gaps), "steady_gap": statistics.median(before), "ttft": max(ttfts)}


@cli.command()
def main(dtype: str = "float32", thresholds: str = "none,256", runs: int = 3, long_prompts: int = 2,
         prompt_tokens: int = 4000, max_num_batched_tokens: int = 1024):
    rows = []
    for threshold in tqdm(thresholds.split(","), desc="thresholds"):
        value = None if threshold == "none" else int(threshold)
        engine = AsyncLLMEngine(dtype=dtype, engine_process=True, num_kv_blocks=1024, max_num_seqs=16,
                                max_num_batched_tokens=max_num_batched_tokens, long_prefill_token_threshold=value)
        try:
            results = [asyncio.run(one_run(engine, run, long_prompts, prompt_tokens)) for run in range(runs)]
        finally:
            engine.shutdown()
        rows.append((threshold, results))
    table = Table(title=f"{long_prompts} prompts of {prompt_tokens} tokens beside one stream, {dtype}, "
                        f"max_num_batched_tokens {max_num_batched_tokens}: median of {runs} runs (each run)")
    for column in ("long_prefill_token_threshold", "stream's steady gap (s)", "longest gap (s)", "long prompts' TTFT (s)"):
        table.add_column(column, justify="right")
    for threshold, results in rows:
        cells = [f"{statistics.median(r[key] for r in results):.2f} ({' · '.join(f'{r[key]:.2f}' for r in results)})"
                 for key in ("steady_gap", "max_gap", "ttft")]
        table.add_row(threshold, *cells)
    Console(width=200).print(table)


if __name__ == "__main__":
    cli()
