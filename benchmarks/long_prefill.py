"""Time to prefill one long prompt alone, by its length: the engine with each bf16 prefill kernel this CPU runs (AMX
tiles, AVX512-BF16) and on SDPA (the same engine, the kernel switched between runs), against vLLM's CPU build on the same token ids, in one run.
Both sides prefill in chunks of the same size, prefix caching off, and produce one token.

python benchmarks/long_prefill.py --lengths 256,1024,2048,4096,6144 --runs 3
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from core_env import restart_as_served  # the sibling script
from vllm_script import run_vllm_script  # the sibling script
from engine import LLM, SamplingParams
from engine.config import DEFAULT_MODEL
from engine.cpu_kernels import build_kernels
from engine.models import resolve_model_path

cli = typer.Typer(add_completion=False)
ROOT = Path(__file__).resolve().parents[1]


def prompts_of(lengths: list[int], vocab: int) -> list[list[int]]:
    return [torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def prefill_kernels(chosen) -> dict:
    """The C++ prefill kernels this CPU runs, the engine's choice first."""
    if chosen is None:
        return {}
    kernels = build_kernels()
    found = {"AMX kernel": kernels.paged_prefill_amx_batch if kernels.has_amx_prefill() else None,
             "AVX-512 kernel": kernels.paged_prefill_batch}
    return {name: op for name, op in found.items() if op is not None}


def engine_seconds(prompts: list[list[int]], runs: int, dtype: str, chunk: int) -> dict[str, dict[int, list[float]]]:
    """Runs alternate between the kernels and SDPA at each length, so both meet the machine in the same state."""
    llm = LLM(dtype=dtype, max_num_batched_tokens=chunk, enable_prefix_caching=False,
              num_kv_blocks=-(-max(map(len, prompts)) // 16) + 8, max_model_len=max(map(len, prompts)) + 16)
    paths = {**prefill_kernels(llm.engine.runner.prefill_kernel), "SDPA": None}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seconds: dict[str, dict[int, list[float]]] = {path: {} for path in paths}
    for ids in tqdm(prompts, desc="engine"):
        for path, op in [*paths.items()] * (runs + 1):
            llm.engine.runner.prefill_kernel = op
            start = time.perf_counter()
            llm.generate([ids], params, use_tqdm=False)
            seconds[path].setdefault(len(ids), []).append(time.perf_counter() - start)
    for lengths in seconds.values():  # the first run of each path at each length was its warm-up
        for n in lengths:
            lengths[n] = lengths[n][1:]
    return seconds


def vllm_seconds(prompts: list[list[int]], runs: int, dtype: str, chunk: int, python: Path, threads: int) -> dict[int, list[float]]:
    seconds = run_vllm_script(python, "vllm_prefill_peer.py", resolve_model_path(DEFAULT_MODEL), prompts,
                              [str(runs), dtype, str(chunk)], threads)
    return {int(n): s for n, s in seconds.items()}


def plot(table: dict[str, dict[int, float]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for system, by_length in table.items():
        lengths = sorted(by_length)
        ax.plot(lengths, [n / by_length[n] for n in lengths], marker="o", label=system)
    ax.set(xlabel="prompt tokens", ylabel="prefill tok/s (one prompt alone)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@cli.command()
def main(lengths: str = typer.Option("256,1024,2048,4096,6144", help="prompt lengths in tokens"),
         runs: int = typer.Option(3, help="timed runs per length and system (medians reported)"),
         dtype: str = "bfloat16", chunk: int = typer.Option(1024, help="max_num_batched_tokens on both sides"),
         threads: int = 2, vllm_python: str = typer.Option(str(ROOT / ".venv-peers/bin/python"), help="'' skips vLLM"),
         out: Path = typer.Option(ROOT / "benchmarks/results", help="where the JSON and PNG go")):
    torch.set_num_threads(threads)
    prompts = prompts_of([int(n) for n in lengths.split(",")], vocab=40000)
    results = {f"engine, {path}": by_length for path, by_length in engine_seconds(prompts, runs, dtype, chunk).items()}
    if vllm_python and Path(vllm_python).exists():
        results["vLLM-CPU"] = vllm_seconds(prompts, runs, dtype, chunk, Path(vllm_python), threads)
    medians = {system: {n: statistics.median(s) for n, s in by_length.items()} for system, by_length in results.items()}
    table = Table(title=f"Prefill of one prompt alone, {dtype}, chunks of {chunk}, {threads} threads (median s, tok/s)")
    table.add_column("prompt tokens", justify="right")
    for system in medians:
        table.add_column(system, justify="right")
    for ids in prompts:
        n = len(ids)
        table.add_row(str(n), *(f"{m[n]:.2f} s  {n / m[n]:,.0f}" for m in medians.values()))
    Console().print(table)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"long-prefill-{stamp}.json").write_text(json.dumps(
        {"dtype": dtype, "chunk": chunk, "threads": threads, "runs": runs, "seconds": results}, indent=1))
    plot(medians, out / f"long-prefill-{stamp}.png", f"Prefill speed by prompt length, {dtype}, {threads} threads")
    print(f"wrote {out / f'long-prefill-{stamp}.json'} and .png")


if __name__ == "__main__":
    restart_as_served()
    cli()
