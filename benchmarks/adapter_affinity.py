"""LoRA adapters loaded on demand (`lora_root`) over several engine replicas: routed to a replica holding the adapter
(`adapter_affinity: true`, Serve's model multiplexing, as Ray Serve LLM routes LoRA requests) against routed as any
request (`false`: Serve's power of two choices), in the same run, alternated. Closed-loop users each send requests
on adapters drawn at random; with more adapters than one replica's `max_loras` but no more than all replicas hold
together, affinity lets each replica keep its share loaded, while spread routing makes every replica take turns
with every adapter. Per mode: adapter loads (the replicas' own `engine_lora_loads_total`), requests per second, TTFT
and end-to-end percentiles. Both apps are deployed side by side with one engine thread per replica.

    python benchmarks/adapter_affinity.py [--users 8] [--requests 12] [--adapters 4] [--max-loras 2]
        [--replicas 2] [--rank 16] [--repeats 3]
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
import typer
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtest.loopback import free_port  # noqa: E402
from loadtest.prompts import paragraph  # noqa: E402
import side_by_side  # noqa: E402  (the sibling script)

MODES = {"affinity": True, "spread": False}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def request(http: httpx.AsyncClient, adapter: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion on `adapter`: TTFT and end to end."""
    body = {"model": adapter, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, first = time.perf_counter(), None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter()
    return {"ttft": first - start, "e2e": time.perf_counter() - start}


async def user(http: httpx.AsyncClient, rng: random.Random, adapters: list[str], requests: int, max_tokens: int,
               bar: tqdm) -> list[dict]:
    results = []
    for _ in range(requests):
        results.append(await request(http, rng.choice(adapters), paragraph(rng, 20, 40), max_tokens))
        bar.update(1)
    return results


def loads(metrics_port: int, app: str) -> float:
    """The app's adapter loads so far, over its replicas (Ray exports each replica's counter)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "ray_engine_lora_loads_total" and sample.labels.get("application") == app)


def settled_loads(metrics_port: int, app: str) -> float:
    """The count once two readings a couple of export periods apart agree (Ray exports every second here)."""
    previous = loads(metrics_port, app)
    while True:
        time.sleep(2.5)
        now = loads(metrics_port, app)
        if now == previous:
            return now
        previous = now


async def one_run(base: str, run: int, mode: str, adapters: list[str], users: int, requests: int,
                  max_tokens: int) -> tuple[list[dict], float]:
    bar = tqdm(total=users * requests, desc=f"run {run}, {mode}", leave=False)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=users)) as http:
        start = time.perf_counter()
        held = await asyncio.gather(*(user(http, random.Random(f"{run}-{u}"), adapters, requests, max_tokens, bar)
                                      for u in range(users)))
        wall = time.perf_counter() - start
    bar.close()
    return [r for results in held for r in results], wall


def deploy(root: str, max_loras: int, replicas: int, dtype: str, port: int, metrics_port: int) -> dict[str, str]:
    return side_by_side.deploy({mode: {
        "engine_config": {"dtype": dtype, "num_threads": 1, "max_num_seqs": 32, "num_kv_blocks": 512,
                          "lora_root": root, "max_loras": max_loras},
        "adapter_affinity": affinity, "min_replicas": replicas, "max_replicas": replicas, "num_cpus": 0}
        for mode, affinity in MODES.items()}, replicas, port, metrics_port)


def main(users: int = 8, requests: int = 12, max_tokens: int = 16,
         adapters: int = typer.Option(4, help="adapters under lora_root, each request's drawn at random"),
         max_loras: int = typer.Option(2, help="adapters each replica keeps loaded"),
         replicas: int = typer.Option(2, help="engine replicas per app, one engine thread each"),
         rank: int = 16, repeats: int = 3, dtype: str = "float32",
         warm_up: bool = typer.Option(False, help="one request on each adapter, one at a time, before the runs: with "
                                                  "affinity each adapter is then held by one replica only")):
    import ray
    from ray import serve

    from engine.config import DEFAULT_MODEL
    from engine.models import resolve_model_path
    from lora import make_adapters  # the sibling script's: random adapters of every linear

    root = Path(tempfile.mkdtemp(prefix="adapter-affinity-"))
    names = [Path(p).name for p in make_adapters(resolve_model_path(DEFAULT_MODEL), adapters, rank, root)]
    metrics_port = free_port()
    bases = deploy(str(root), max_loras, replicas, dtype, free_port(), metrics_port)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        for mode in MODES if warm_up else ():
            asyncio.run(one_run(bases[mode], -1, mode, names, 1, len(names), max_tokens))
        for run in range(repeats):
            for mode in (list(MODES) if run % 2 == 0 else list(MODES)[::-1]):  # alternated
                before = settled_loads(metrics_port, mode)
                results, wall = asyncio.run(one_run(bases[mode], run, mode, names, users, requests, max_tokens))
                runs[mode].append({"adapter loads": settled_loads(metrics_port, mode) - before,
                                   "req/s": len(results) / wall,
                                   "ttft p50": percentile([r["ttft"] for r in results], 0.5),
                                   "ttft p90": percentile([r["ttft"] for r in results], 0.9),
                                   "e2e p50": percentile([r["e2e"] for r in results], 0.5)})
    finally:
        serve.shutdown()
        ray.shutdown()
    table = Table(title=f"{users} users x {requests} requests on {adapters} adapters (rank {rank}, drawn at random), "
                        f"max_loras {max_loras}, {replicas} replicas (1 engine thread each), {max_tokens} tokens a "
                        f"request, {dtype}: medians of {repeats} runs")
    columns = list(runs["affinity"][0])
    table.add_column("routing", no_wrap=True)
    for column in columns:
        table.add_column(column + (" s" if column.startswith(("ttft", "e2e")) else ""), justify="right")
    summary = {mode: {c: statistics.median(r[c] for r in runs[mode]) for c in columns} for mode in MODES}
    for mode, row in summary.items():
        table.add_row(mode, *(f"{v:.0f}" if c == "adapter loads" else f"{v:.2f}" for c, v in row.items()))
    Console().print(table)
    print(json.dumps({"summary": summary, "runs": runs}))


if __name__ == "__main__":
    typer.run(main)
