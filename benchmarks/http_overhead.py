"""HTTP through Ray Serve against the engine driven directly: requests/s on one workload, 64 concurrent streams.

python benchmarks/http_overhead.py [--requests 256] [--concurrency 64]
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import time

import httpx
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from engine import AsyncLLMEngine, SamplingParams
from workload import chat_workload  # the sibling script; run as python benchmarks/http_overhead.py

app = typer.Typer(add_completion=False)
console = Console()


async def bounded(jobs, concurrency: int, desc: str) -> float:
    semaphore = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(jobs), desc=desc)

    async def run(job):
        async with semaphore:
            await job()
            bar.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(run(j) for j in jobs))
    bar.close()
    return time.perf_counter() - start


async def direct(requests, concurrency: int, dtype: str, threads: int) -> float:
    engine = AsyncLLMEngine(dtype=dtype, max_num_seqs=concurrency, num_threads=threads)

    def job(r):
        async def go():
            async for _ in engine.generate(r.messages, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)):
                pass
        return go

    try:
        return await bounded([job(r) for r in requests], concurrency, "direct")
    finally:
        engine.shutdown()


async def over_http(requests, concurrency: int, dtype: str, threads: int) -> float:
    import ray
    from ray import serve

    from serve_app.app import build_app

    os.environ.setdefault("RAY_worker_niceness", "0")  # as make serve: Ray's default nice 15 starves the replica
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8011})
        args = {"engine": {"dtype": dtype, "max_num_seqs": concurrency, "num_threads": threads}}
        serve.run(build_app(args), name="llm", route_prefix="/")
        async with httpx.AsyncClient(base_url="http://127.0.0.1:8011", timeout=600,
                                     limits=httpx.Limits(max_connections=concurrency)) as client:
            def job(r):
                async def go():
                    body = {"messages": r.messages, "max_tokens": r.max_tokens, "temperature": 0, "stream": True,
                            "ignore_eos": True}
                    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                        assert resp.status_code == 200
                        async for _ in resp.aiter_lines():
                            pass
                return go
            return await bounded([job(r) for r in requests], concurrency, "http")
    finally:
        serve.shutdown()
        ray.shutdown()


@app.command()
def main(requests: int = 256, concurrency: int = 64, dtype: str = "bfloat16", runs: int = 1,
         threads: int = typer.Option(1, help="engine threads on both paths (1, as serve_app/config.yaml on 2 cores)")):
    workload = chat_workload(requests, 16, 128, seed=1)  # ignore_eos on both paths: identical output lengths
    direct_s = [asyncio.run(direct(workload, concurrency, dtype, threads)) for _ in range(runs)]
    http_s = [asyncio.run(over_http(workload, concurrency, dtype, threads)) for _ in range(runs)]
    d, h = requests / statistics.median(direct_s), requests / statistics.median(http_s)
    table = Table(title=f"{requests} chat requests, {concurrency} concurrent streams, {dtype}")
    for c in ("path", "req/s", "share of direct"):
        table.add_column(c, justify="right")
    table.add_row("engine directly", f"{d:.2f}", "100%")
    table.add_row("HTTP via Ray Serve", f"{h:.2f}", f"{h / d:.0%}")
    console.print(table)
    print(json.dumps({"direct_rps": d, "http_rps": h, "ratio": h / d, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    app()
