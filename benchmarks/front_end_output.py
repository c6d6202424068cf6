"""The front end's output half a step: the core's new token per stream becomes each stream's text and a
RequestOutput (detokenizing, stop strings, the totals), on the one thread that does it beside a core process. On a
GPU a step is a few milliseconds, so at a batch of 256 this thread must keep up with the core; its cost must not grow
with how long the streams have run. Median of rounds of steps, at a given length of every stream so far; the
embedded model's tokenizer.

python benchmarks/front_end_output.py --batch 256 --lengths 100,1000,2000 --out benchmarks/results/front-end-output.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cpu_flags  # noqa: E402  the sibling script

cli = typer.Typer(add_completion=False)
TEXT = " the sea was calm and the ship sailed on past the harbour lights" * 100


def measure(tokenizer, batch: int, length: int, rounds: int, steps: int) -> dict:
    from engine.core_messages import CoreOutput, EngineRequest
    from engine.output_processor import OutputProcessor
    from engine.sampling_params import SamplingParams
    from engine.sequence import RequestMetrics

    processor = OutputProcessor(tokenizer, [tokenizer.eos_token_id])
    prompt = tokenizer.encode("Tell me a long story about the sea.")
    limit = length + rounds * steps + 1
    for i in range(batch):
        processor.add(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=limit), limit, 0.0))
    ids, metrics = tokenizer.encode(TEXT), RequestMetrics(0.0)
    step = lambda n: processor.process([CoreOutput(f"r{i}", [ids[n % len(ids)]], metrics) for i in range(batch)])  # noqa: E731
    for n in range(length):  # the streams so far
        step(n)
    times = []
    for r in range(rounds):
        started = time.perf_counter()
        for n in range(steps):
            step(length + r * steps + n)
        times.append((time.perf_counter() - started) / steps)
    return {"batch": batch, "length": length, "ms_a_step": round(1e3 * statistics.median(times), 3)}


@cli.command()
def main(batch: int = 256, lengths: str = "100,1000,2000", rounds: int = 5, steps: int = 50, out: Path | None = None):
    """Writes rows of milliseconds a step by the streams' length so far."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from engine.models import embedded_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    rows = [measure(tokenizer, batch, int(n), rounds, steps) for n in tqdm(lengths.split(","), desc="lengths")]
    table = Table(title=f"front end's output processing, {batch} streams (median of {rounds} rounds of {steps} steps)")
    for column in ("batch", "length", "ms_a_step"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in ("batch", "length", "ms_a_step")))
    Console().print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_flags(), "rows": rows}, indent=2))


if __name__ == "__main__":
    cli()
