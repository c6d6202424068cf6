"""N-gram speculative decoding, on and off, in one run (make bench ARGS="--speculative"): per-request decode speed at
low load (1-4 requests in flight, a closed loop over the engine's step) on a copy-heavy subset and on the default mix,
and throughput at high load (the whole default mix at once). Greedy in fp32, so both sides must produce the same
tokens: the script checks it, then reports the speed-up and the acceptance rate.

python benchmarks/speculative.py --weights dense,gguf --concurrency 1,2,4 --runs 3
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

from bench import cpu_flags  # the sibling scripts
from engine import LLM, SamplingParams
from engine.config import EngineConfig, SpeculativeConfig
from workload import Request, chat_workload, copy_workload

cli = typer.Typer(add_completion=False)
console = Console(width=160)


def engine_for(weights: str, dtype: str, threads: int, speculative: bool, k: int) -> LLM:
    return LLM(config=EngineConfig(dtype=dtype, num_threads=threads, quantization=None if weights == "dense" else "gguf",
                                   num_kv_blocks=4096, max_num_seqs=128, max_num_batched_tokens=2048,
                                   speculative=SpeculativeConfig(num_speculative_tokens=k) if speculative else None))


def closed_loop(llm: LLM, requests: list[Request], concurrency: int, ignore_eos: bool) -> dict:
    """Keep `concurrency` requests in flight until all are done. Per request: decode tok/s from its first token to
    its last. Returns the medians, the wall time, the tokens and each request's output ids."""
    queue = list(enumerate(requests))
    first, last, outputs = {}, {}, {}
    start = time.perf_counter()

    in_flight = set()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            i, r = queue.pop(0)
            llm.add_request(str(i), r.messages, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                      ignore_eos=ignore_eos))
            in_flight.add(str(i))
        for out in llm.step():
            now = time.perf_counter()
            if out.delta_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
            if out.finished:
                in_flight.discard(out.request_id)
                outputs[int(out.request_id)] = out.token_ids
    wall = time.perf_counter() - start
    speeds = [(len(outputs[int(rid)]) - 1) / (last[rid] - first[rid]) for rid in first if last[rid] > first[rid]]
    return {"decode_tok_s": statistics.median(speeds), "wall_s": wall,
            "tokens": sum(map(len, outputs.values())), "outputs": [outputs[i] for i in range(len(requests))]}


def measure(llm: LLM, requests: list[Request], concurrency: int, runs: int, ignore_eos: bool) -> dict:
    before = llm.engine.stats()
    results = [closed_loop(llm, requests, concurrency, ignore_eos) for _ in range(runs)]
    after = llm.engine.stats()
    proposed = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in results),
            "throughput_tok_s": statistics.median(r["tokens"] / r["wall_s"] for r in results),
            "runs_decode_tok_s": [round(r["decode_tok_s"], 1) for r in results],
            "acceptance": accepted / proposed if proposed else None,
            "accepted_per_step": accepted / max(1, after.num_steps - before.num_steps),
            "outputs": results[-1]["outputs"]}


@cli.command()
def main(weights: str = "dense,gguf", dtype: str = "float32", concurrency: str = "1,2,4", runs: int = 3,
         threads: int = 2, k: int = 4, copy_requests: int = 8, mix_requests: int = 8, high_load_requests: int = 64,
         out_dir: Path = Path("benchmarks/results")):
    levels = [int(c) for c in concurrency.split(",")]
    workloads = {"copy-heavy": (copy_workload(copy_requests), False),
                 "default mix": (chat_workload(mix_requests, 32, 128, seed=1), True)}
    high = chat_workload(high_load_requests, 16, 128, seed=2)
    rows = []
    for weight in tqdm(weights.split(","), desc="weights"):
        engines = {spec: engine_for(weight, dtype, threads, spec, k) for spec in (False, True)}
        for llm in engines.values():
            closed_loop(llm, copy_workload(1, 8, seed=9), 1, False)  # warm-up
        cases = [(name, reqs, level, eos) for name, (reqs, eos) in workloads.items() for level in levels]
        cases.append(("default mix, high load", high, len(high), True))
        for name, reqs, level, ignore_eos in tqdm(cases, desc=f"{weight} cases", leave=False):
            off, on = (measure(engines[spec], reqs, level, runs, ignore_eos) for spec in (False, True))
            rows.append({"weights": weight, "dtype": dtype, "workload": name, "concurrency": level,
                         "off_decode_tok_s": off["decode_tok_s"], "on_decode_tok_s": on["decode_tok_s"],
                         "off_throughput_tok_s": off["throughput_tok_s"], "on_throughput_tok_s": on["throughput_tok_s"],
                         "off_runs": off["runs_decode_tok_s"], "on_runs": on["runs_decode_tok_s"],
                         "acceptance": on["acceptance"], "accepted_per_step": on["accepted_per_step"],
                         "identical_outputs": sum(a == b for a, b in zip(off["outputs"], on["outputs"])),
                         "requests": len(reqs)})
        del engines
    report(rows, dict(dtype=dtype, threads=threads, k=k, runs=runs, cpu_flags=cpu_flags()), out_dir)


def report(rows: list[dict], settings: dict, out_dir: Path) -> None:
    table = Table(title=f"speculation off / on, {settings['dtype']}, {settings['threads']} threads, k={settings['k']}, "
                        f"median of {settings['runs']} runs")
    for column in ("weights", "workload", "in flight", "decode tok/s off", "on", "x", "throughput off", "on", "x",
                   "acceptance", "identical"):
        table.add_column(column, justify="left" if column in ("weights", "workload") else "right")
    for r in rows:
        table.add_row(r["weights"], r["workload"], str(r["concurrency"]), f"{r['off_decode_tok_s']:.1f}",
                      f"{r['on_decode_tok_s']:.1f}", f"{r['on_decode_tok_s'] / r['off_decode_tok_s']:.2f}x",
                      f"{r['off_throughput_tok_s']:.1f}", f"{r['on_throughput_tok_s']:.1f}",
                      f"{r['on_throughput_tok_s'] / r['off_throughput_tok_s']:.2f}x",
                      "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}", f"{r['identical_outputs']}/{r['requests']}")
    console.print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"speculative-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    path.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    cli()
