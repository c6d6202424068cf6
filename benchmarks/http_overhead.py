"""HTTP through Ray Serve against the engine driven directly: requests/s on one workload, 64 concurrent streams.
The HTTP path runs with the engine core in its own process (serving's default) and, for comparison, on a thread
of the replica.

python benchmarks/http_overhead.py [--requests 256] [--concurrency 64] [--quantization gguf] [--cores process,thread]
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


async def direct(requests, concurrency: int, engine_args: dict) -> float:
    engine = AsyncLLMEngine(**engine_args)

    def job(r):
        async def go():
            async for _ in engine.generate(r.messages, SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)):
                pass
        return go

    try:
        return await bounded([job(r) for r in requests], concurrency, "direct")
    finally:
        engine.shutdown()


async def over_http(requests, concurrency: int, engine_args: dict, engine_process: bool) -> float:
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.ray_env import setdefault_ray_env

    setdefault_ray_env()  # as make serve
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8011})
        args = {"engine_config": {**engine_args, "engine_process": engine_process}}
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
            return await bounded([job(r) for r in requests], concurrency, f"http, core {'process' if engine_process else 'thread'}")
    finally:
        serve.shutdown()
        ray.shutdown()


@app.command()
def main(requests: int = 256, concurrency: int = 64, dtype: str = "bfloat16", runs: int = 1,
         threads: int = typer.Option(1, help="engine threads on every path (1, as serve_app/config.yaml on 2 cores)"),
         quantization: str | None = typer.Option(None, help="gguf: the embedded model's blocks, as serve_app/config.yaml"),
         cores: str = typer.Option("process,thread", help="where the HTTP path's engine core runs, in order")):
    workload = chat_workload(requests, 16, 128, seed=1)  # ignore_eos on every path: identical output lengths
    engine_args = {"dtype": dtype, "max_num_seqs": concurrency, "num_threads": threads, "quantization": quantization}
    paths = {"engine directly": lambda: direct(workload, concurrency, engine_args)}
    for core in cores.split(","):
        paths[f"HTTP via Ray Serve, core {core}"] = lambda p=core == "process": over_http(workload, concurrency, engine_args, p)
    rps = {}
    for name, path in paths.items():
        rps[name] = requests / statistics.median(asyncio.run(path()) for _ in range(runs))
    direct_rps = rps["engine directly"]
    table = Table(title=f"{requests} chat requests, {concurrency} concurrent streams, {dtype}, {threads} engine thread(s)")
    for c in ("path", "req/s", "share of direct"):
        table.add_column(c, justify="right")
    for name, value in rps.items():
        table.add_row(name, f"{value:.2f}", f"{value / direct_rps:.0%}")
    console.print(table)
    print(json.dumps({"rps": rps, "ratios": {k: v / direct_rps for k, v in rps.items()}, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    app()
