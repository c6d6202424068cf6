"""Multi-turn chat over engine replicas: Serve's default router (power of two choices) against
`request_router: prefix_affinity`, in the same run, alternated. Closed-loop users each hold conversations about a
document of their own; every turn resends the whole history, as chat clients do, after a think time (a person
reading the answer; without it, the replica that just answered a user is the less busy one when the next turn is
routed, and Serve's default looks sticky for two replicas). Per router: the share of prompt
tokens served from the prefix cache, the share of later turns that found their history, TTFT and end-to-end
percentiles, and requests per second. Both apps are deployed side by side with one engine thread per replica and
driven one at a time; each run's conversations are new, so no run inherits another's cache.

    python benchmarks/prefix_routing.py [--users 8] [--conversations 2] [--turns 4] [--document-words 700]
        [--think-s 2] [--system-words 0] [--replicas 2] [--repeats 3]
    python benchmarks/prefix_routing.py --decision-only
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtest.loopback import free_port  # noqa: E402
from loadtest.prompts import paragraph  # noqa: E402
import side_by_side  # noqa: E402  (the sibling script)

ROUTERS = ("power_of_two", "prefix_affinity")
BLOCK_SIZE = 16
QUESTIONS = ["Summarise the document in two sentences.", "Which words does it repeat most?", "What is its tone?",
             "Suggest a title for it.", "Name one thing it leaves out.", "Rewrite its first sentence."]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def turn(http: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat turn; its answer appended to `messages`. TTFT, end to end, and usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage = None, [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
    messages.append({"role": "assistant", "content": "".join(text)})
    return {"ttft": first - start, "e2e": time.perf_counter() - start, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


@dataclass
class Workload:
    users: int
    conversations: int  # each user's, one after another
    turns: int
    document_words: int  # each conversation's own document, in its first turn
    system_words: int  # a system prompt every conversation of a run shares (0: none)
    max_tokens: int
    think_s: float


async def user(http: httpx.AsyncClient, rng: random.Random, name: str, system: str, work: Workload,
               bar: tqdm) -> list[list[dict]]:
    held = []
    for number in range(work.conversations):
        document = paragraph(rng, work.document_words, work.document_words)
        messages, results = [{"role": "system", "content": system}] if system else [], []
        for question in rng.sample(QUESTIONS, work.turns):
            await asyncio.sleep(rng.uniform(0.5, 1.5) * work.think_s)
            first = len(results) == 0
            content = f"{name}, conversation {number}.\n\n{document}\n\n{question}" if first else question
            messages.append({"role": "user", "content": content})
            results.append(await turn(http, messages, work.max_tokens))
            bar.update(1)
        held.append(results)
    return held


async def one_run(base: str, run: int, work: Workload, router: str) -> dict:
    bar = tqdm(total=work.users * work.conversations * work.turns, desc=f"run {run}, {router}", leave=False)
    system = paragraph(random.Random(f"system-{run}"), work.system_words, work.system_words) if work.system_words else ""
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=work.users)) as http:
        start = time.perf_counter()
        held = await asyncio.gather(*(user(http, random.Random(f"{run}-{u}"), f"Run {run}, user {u}", system, work, bar)
                                      for u in range(work.users)))
        wall = time.perf_counter() - start
    bar.close()
    requests = [r for conversation_list in held for conversation in conversation_list for r in conversation]
    later = [(before, after) for conversation_list in held for conversation in conversation_list
             for before, after in zip(conversation, conversation[1:])]
    found = sum(a["cached"] >= b["prompt"] - BLOCK_SIZE for b, a in later) / len(later) if later else float("nan")
    return {"cached share": sum(r["cached"] for r in requests) / sum(r["prompt"] for r in requests),
            "history found": found,
            "ttft p50": percentile([r["ttft"] for r in requests], 0.5),
            "ttft p90": percentile([r["ttft"] for r in requests], 0.9),
            "e2e p50": percentile([r["e2e"] for r in requests], 0.5),
            "req/s": len(requests) / wall}


def deploy(dtype: str, replicas: int, kv_blocks: int | None, port: int) -> dict[str, str]:
    return side_by_side.deploy({router: {
        "engine_config": {"dtype": dtype, "num_threads": 1, "max_num_seqs": 32, "num_kv_blocks": kv_blocks},
        "request_router": router, "min_replicas": replicas, "max_replicas": replicas, "num_cpus": 0,
        "report_cached_tokens": True} for router in ROUTERS}, replicas, port)


def decision_cost() -> None:
    """What one routing decision costs the ingress's event loop: the key, its chunk hashes, the lookup and the record,
    for chat prompts of growing size, against an index already holding 10,000 other conversations."""
    import timeit

    from engine import SamplingParams
    from serve_app.prefix_affinity import PrefixAffinityOptions, PrefixIndex, affinity_key
    from serve_app.protocol import GenerationJob

    options = PrefixAffinityOptions()
    index = PrefixIndex(options.chunk_chars, options.max_chunks)
    rng = random.Random(0)
    for number in range(10_000):
        index.record(index.chunk_hashes(f"{number} " + paragraph(rng, 200, 200)), f"replica-{number % 8}")
    table = Table(title="one routing decision (key, hashes, lookup, record), medians of 5 timings")
    for column in ("prompt characters", "chunks", "microseconds"):
        table.add_column(column, justify="right")
    for size in (1_000, 10_000, 100_000, 1_000_000):
        job = GenerationJob("r", [{"role": "user", "content": paragraph(rng, size // 7, size // 7)[:size]}],
                            SamplingParams(max_tokens=1))

        def decide():
            hashes = index.chunk_hashes(affinity_key(job))
            index.longest_match(hashes, {f"replica-{n}" for n in range(8)})
            index.record(hashes, "replica-0")

        runs = 20 if size < 1_000_000 else 3
        seconds = statistics.median(timeit.repeat(decide, number=runs, repeat=5)) / runs
        table.add_row(f"{size:,}", f"{size // options.chunk_chars:,}", f"{seconds * 1e6:,.0f}")
    Console().print(table)


def main(users: int = 8, conversations: int = 2, turns: int = 4, document_words: int = 700, max_tokens: int = 32,
         think_s: float = typer.Option(2.0, help="mean pause before each turn (uniform, 0.5x to 1.5x)"),
         system_words: int = typer.Option(0, help="a system prompt of this many words that every conversation shares"),
         replicas: int = typer.Option(2, help="engine replicas per app, one engine thread each"),
         kv_blocks: int = typer.Option(None, help="KV blocks per replica (default: the engine's sizing, ~2 GB each): "
                                                  "both apps' replicas must fit in memory together"),
         repeats: int = 3, dtype: str = "bfloat16",
         decision_only: bool = typer.Option(False, help="time one routing decision in this process, and stop")):
    if decision_only:
        return decision_cost()
    import ray
    from ray import serve

    work = Workload(users, conversations, turns, document_words, system_words, max_tokens, think_s)
    bases = deploy(dtype, replicas, kv_blocks, free_port())
    try:
        runs: dict[str, list[dict]] = {router: [] for router in ROUTERS}
        for run in range(repeats):
            order = ROUTERS if run % 2 == 0 else ROUTERS[::-1]  # alternated: the first of a pair can run faster
            for router in order:
                runs[router].append(asyncio.run(one_run(bases[router], run, work, router)))
    finally:
        serve.shutdown()
        ray.shutdown()
    table = Table(title=f"{users} users x {conversations} conversations x {turns} turns over {replicas} replicas (1 "
                        f"engine thread each), documents of {document_words} words, a shared system prompt of "
                        f"{system_words} words, {max_tokens} tokens a turn, "
                        f"think time {think_s} s, {dtype}: "
                        f"medians of {repeats} runs")
    columns = list(runs[ROUTERS[0]][0])
    table.add_column("router", no_wrap=True)
    for column in columns:
        table.add_column(column + (" s" if column.startswith(("ttft", "e2e")) else ""), justify="right")
    summary = {}
    for router in ROUTERS:
        summary[router] = {c: statistics.median(r[c] for r in runs[router]) for c in columns}
        table.add_row(router, *(f"{v:.0%}" if "share" in c or "found" in c else f"{v:.2f}"
                                for c, v in summary[router].items()))
    Console().print(table)
    print(json.dumps({"summary": summary, "runs": runs}))


if __name__ == "__main__":
    typer.run(main)
