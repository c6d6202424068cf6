"""Serving CPU per output token (issue 45): what each serving process spends per 1,000 output tokens at 1, 16, 64 and
128 concurrent clients, streamed and not, for this app (Ray Serve's proxy, the ingress, the replica's front end) and
for vLLM's OpenAI server (its API process), in one run. Each engine core is reported beside them, not in the serving
sum: it also runs the model (vLLM's core is its EngineCore and Worker processes). One server at a time; the client is this process, never counted.

make bench-serving                         # both systems; ARGS="--seconds 20 --levels 1,16" for a short run
python benchmarks/serving_cost.py --only engine --proxies python,haproxy   # Serve's proxy against HAProxy mode
python benchmarks/serving_cost.py --only engine --topologies split,colocated  # the engine's front end in the ingress
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import matplotlib
import psutil
import typer
from rich.console import Console
from rich.table import Table

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench import cpu_flags  # noqa: E402  (the sibling scripts)
from sweep_servers import MODEL_NAME, vllm_dtype, vllm_server  # noqa: E402
from loadtest.run import embedded_app  # noqa: E402
from serve_app.config import shipped_app_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
console = Console()
cli = typer.Typer(add_completion=False)
PROMPT = "Write a long story about a lighthouse keeper who counts ships."
ROLES = ("proxy", "ingress", "replica", "api server", "core", "other")  # the first four are serving
SERVING = ("proxy", "ingress", "replica", "api server")


@dataclass
class Level:
    system: str
    streamed: bool
    clients: int
    seconds: float
    requests: int = 0  # that ran in the window, wholly or in part
    failed: int = 0
    output_tokens: int = 0  # made in the window, prorated per request
    cpu_s: dict[str, float] = field(default_factory=dict)  # per role, over the window

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def ms_per_1k(self, role: str) -> float:
        return 1e6 * self.cpu_s.get(role, 0.0) / max(self.output_tokens, 1)

    @property
    def serving_ms_per_1k(self) -> float:
        return sum(self.ms_per_1k(role) for role in SERVING)


def role_of(proc: psutil.Process, api_pid: int | None) -> str:
    """Which part of a server a process is, by its command line (Ray names its workers by deployment)."""
    try:
        text = " ".join(proc.cmdline()) + " " + proc.name()
    except psutil.Error:
        return "other"
    if proc.pid == api_pid:
        return "api server"
    for marker, role in (("ProxyActor", "proxy"), ("HAProxyManager", "proxy"), ("haproxy", "proxy"), ("Ingress", "ingress"),
                         ("EngineReplica", "replica"), ("engine.core_process", "core"), ("VLLM::EngineCore", "core"), ("VLLM::Worker", "core")):
        if marker in text:
            return role
    return "other"


def server_processes(api_pid: int | None) -> list[psutil.Process]:
    """The server's processes: Ray's (any process of a Ray session) or the peer's tree; never this client."""
    me = os.getpid()
    if api_pid is not None:
        root = psutil.Process(api_pid)
        return [root, *root.children(recursive=True)]
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        words = " ".join(proc.info["cmdline"] or [])
        if proc.pid != me and any(marker in words for marker in ("ray::", "ray/", "engine.core_process", "raylet",
                                                                 "gcs_server", "haproxy")):
            found.append(proc)
    return found


def cpu_by_role(procs: list[psutil.Process], api_pid: int | None) -> dict[str, float]:
    totals: dict[str, float] = {}
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        role = role_of(proc, api_pid)
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


async def client_loop(client: httpx.AsyncClient, url: str, streamed: bool, max_tokens: int, stop_at: float,
                      window_start: float, level: Level, rng: random.Random) -> None:
    """Requests back to back until the window ends. A request's tokens count in the share of its life that fell in
    the window (decode makes them at an even pace), so requests that finish together, as closed-loop clients that
    start together do, cannot make the count jump by a whole wave; their lengths vary for the same reason."""
    while time.monotonic() < stop_at:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "temperature": 1.0,
                "max_tokens": rng.randint(max_tokens // 2, max_tokens * 3 // 2), "ignore_eos": True, "stream": streamed}
        if streamed:
            body["stream_options"] = {"include_usage": True}
        started = time.monotonic()
        try:
            tokens = await (_streamed(client, url, body) if streamed else _whole(client, url, body))
        except (httpx.HTTPError, ValueError, KeyError):
            level.failed += 1
            continue
        ended = time.monotonic()
        overlap = min(ended, stop_at) - max(started, window_start)
        if overlap > 0:
            level.requests += 1
            level.output_tokens += round(tokens * overlap / max(ended - started, 1e-9))


async def _whole(client: httpx.AsyncClient, url: str, body: dict) -> int:
    r = await client.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def _streamed(client: httpx.AsyncClient, url: str, body: dict) -> int:
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def measure(system: str, url: str, api_pid: int | None, streamed: bool, clients: int, warmup: float,
                  seconds: float, max_tokens: int) -> Level:
    level = Level(system, streamed, clients, seconds)
    started = time.monotonic()
    window_start, stop_at = started + warmup, started + warmup + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        rng = random.Random(clients)
        tasks = [asyncio.create_task(client_loop(client, url, streamed, max_tokens, stop_at, window_start, level, rng))
                 for _ in range(clients)]
        await asyncio.sleep(max(0.0, window_start - time.monotonic()))
        procs = server_processes(api_pid)
        before = cpu_by_role(procs, api_pid)
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        after = cpu_by_role(procs, api_pid)
        await asyncio.gather(*tasks)  # requests still running finish; their share in the window counts
    level.cpu_s = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
    return level


def run_system(system: str, url: str, api_pid: int | None, levels: list[int], modes: list[bool], warmup: float,
               seconds: float, max_tokens: int) -> list[Level]:
    results = []
    for streamed in modes:
        for clients in levels:
            console.print(f"{system}: {clients} clients, {'streamed' if streamed else 'not streamed'}, "
                          f"{warmup:.0f} s warm-up + {seconds:.0f} s")
            level = asyncio.run(measure(system, url, api_pid, streamed, clients, warmup, seconds, max_tokens))
            console.print(f"  {level.tokens_per_s:.0f} tok/s, serving {level.serving_ms_per_1k:.0f} ms CPU per 1k tokens, "
                          f"{level.failed} failed")
            results.append(level)
    return results


@cli.command()
def main(levels: str = typer.Option("1,16,64,128", help="concurrent clients, comma separated"),
         modes: str = typer.Option("stream,whole", help="stream, whole or both"),
         seconds: float = typer.Option(40, help="measured window per level"),
         warmup: float = typer.Option(10, help="load before the window, per level"),
         max_tokens: int = typer.Option(128, help="mean output length; each request draws from half to 1.5 times it"),
         only: str = typer.Option("", help="engine or vllm; both by default"),
         proxies: str = typer.Option("haproxy", help="this app's front: haproxy (Serve's high-throughput mode, as "
                                     "make serve), python (Serve's Python proxy), or both in one run: python,haproxy"),
         topologies: str = typer.Option("", help="this app's topology (AppArgs.topology): split, colocated, or "
                                        "both in one run: split,colocated; serve_app/config.yaml's by default"),
         app_args: str = typer.Option("{}", help="JSON of AppArgs fields laid over serve_app/config.yaml's, e.g. "
                                      "'{\"stream_interval\": 4, \"stream_chunks_per_step\": null}'"),
         vllm_python: Path = Path(".venv-peers/bin/python"),
         out_dir: Path = Path("benchmarks/results")):
    counts = [int(x) for x in levels.split(",")]
    stream_modes = [m.strip() == "stream" for m in modes.split(",")]
    results: list[Level] = []
    if only in ("", "engine"):
        for topology in (topologies or shipped_app_args().topology).split(","):
            for proxy in proxies.split(","):
                haproxy = proxy.strip() == "haproxy"
                with embedded_app(throughput=haproxy, args={**json.loads(app_args), "topology": topology.strip()}) as url:
                    label = f"engine ({topology.strip()}{'' if haproxy else ', Python proxy'})"
                    results += run_system(label, url, None, counts, stream_modes, warmup, seconds, max_tokens)
    if only in ("", "vllm"):
        results += run_vllm(vllm_python, counts, stream_modes, warmup, seconds, max_tokens)
    report(results, out_dir)


def run_vllm(vllm_python: Path, counts: list[int], modes: list[bool], warmup: float, seconds: float,
             max_tokens: int) -> list[Level]:
    log_path = ROOT / "loadtest/reports/serving-cost-vllm.log"  # ignored by git, beside the load test's reports
    with vllm_server(vllm_python, vllm_dtype(), log_path) as (url, pid):  # auto, as serve_app/config.yaml's dtype
        return run_system("vLLM CPU (OpenAI server)", url, pid, counts, modes, warmup, seconds, max_tokens)


def report(results: list[Level], out_dir: Path) -> None:
    table = Table(title="CPU ms per 1,000 output tokens, by process (serving = all but core and other)")
    for column in ("system", "mode", "clients", "tok/s", "failed", *ROLES, "serving", "tok/s per serving core"):
        table.add_column(column, justify="right")
    for r in results:
        serving = r.serving_ms_per_1k
        table.add_row(r.system, "stream" if r.streamed else "whole", str(r.clients), f"{r.tokens_per_s:.0f}",
                      str(r.failed), *(f"{r.ms_per_1k(role):.0f}" if role in r.cpu_s else "-" for role in ROLES),
                      f"{serving:.0f}", f"{1e6 / serving:,.0f}" if serving else "-")
    console.print(table)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"serving-cost-{stamp}.json"
    path.write_text(json.dumps({"cpu_flags": cpu_flags(), "levels": [asdict(r) for r in results]}, indent=2))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for system in dict.fromkeys(r.system for r in results):
        for streamed in (True, False):
            rows = [r for r in results if r.system == system and r.streamed == streamed]
            if rows:
                ax.plot([r.clients for r in rows], [r.serving_ms_per_1k for r in rows], "o-" if streamed else "s--",
                        label=f"{system}, {'streamed' if streamed else 'not streamed'}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("serving CPU ms per 1,000 output tokens")
    ax.set_title("Serving cost per token (engine cores excluded)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=90)
    console.print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    cli()
