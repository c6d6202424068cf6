"""What sampling costs a decode step on CPU: the embedded model generating for a batch of chat-like prompts, greedy
and sampled (top-p at each temperature given), wall time and the engine's own sample phase per step, medians of
several rounds. Run it in two trees (a worktree of the code before) to compare them on one machine.

python benchmarks/sampled_decode.py --batch 32 --tokens 64 --temperatures 0.8,1.0 --out benchmarks/results/sampled.json
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
TOPICS = ("a robot who learns to paint", "the history of the moon landings", "why the sky is blue",
          "a recipe for bread", "the rules of chess", "a lighthouse keeper's day", "how a compiler works")


def prompts(batch: int) -> list[str]:
    return [f"Write about {TOPICS[i % len(TOPICS)]}, part {i}." for i in range(batch)]


def measure(llm, batch: int, tokens: int, sampling: dict) -> dict:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=1, **sampling)
    engine = llm.engine
    sampled_before, steps_before = engine.phases.seconds["sample"], engine.counters["num_steps"]
    started = time.perf_counter()
    llm.generate(prompts(batch), params, use_tqdm=False)
    wall = time.perf_counter() - started
    steps = engine.counters["num_steps"] - steps_before
    return {"wall_s": wall, "sample_ms_per_step": 1e3 * (engine.phases.seconds["sample"] - sampled_before) / steps}


@cli.command()
def main(batch: int = 32, tokens: int = 64, temperatures: str = "0.8,1.0", top_p: float = 0.95, rounds: int = 3,
         dtype: str = "float32", out: Path | None = None):
    """Rows of wall seconds and sample-phase ms per step by sampling setting (medians of `rounds`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from engine import LLM

    llm = LLM(dtype=dtype, max_num_seqs=batch)
    llm.generate(prompts(2), None, use_tqdm=False)  # first-call costs
    settings = [("greedy", dict(temperature=0.0))] + [
        (f"T {t}, top-p {top_p}", dict(temperature=float(t), top_p=top_p)) for t in temperatures.split(",")]
    runs = {name: [] for name, _ in settings}
    for _ in tqdm(range(rounds), desc="rounds", unit="round"):
        for name, sampling in settings:  # interleaved, so a slow minute of the machine spreads over every row
            runs[name].append(measure(llm, batch, tokens, sampling))
    rows = [{"sampling": name, "batch": batch, "tokens": tokens,
             **{key: round(statistics.median(r[key] for r in runs[name]), 3) for key in runs[name][0]}}
            for name, _ in settings]
    table = Table(title=f"batch {batch}, {tokens} tokens each, {dtype} (median of {rounds})")
    for column in ("sampling", "wall_s", "sample_ms_per_step"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["sampling"], str(row["wall_s"]), str(row["sample_ms_per_step"]))
    Console().print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_flags(), "dtype": dtype, "rows": rows}, indent=2))


if __name__ == "__main__":
    cli()
