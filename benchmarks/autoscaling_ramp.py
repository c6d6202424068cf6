"""The same load ramp under Serve's request-count autoscaling and under the engine-signal policy (issue 44), on one
local Ray node: a phase of short chats, a phase of few long-context requests that fill the KV pool while the
request count stays under target_ongoing_requests, then quiet. Records every second the replica count, the KV pool
use and the waiting requests (each replica's engine stats through the deployment handle), and each request's time
to first token; prints a table and writes a PNG and a JSON to benchmarks/results/.

    python benchmarks/autoscaling_ramp.py [--short-s 30] [--long-s 90] [--quiet-s 45] [--threads 1]

--threads: each replica's engine threads (default: all cores). With 1, a replica owns one of the 2 cores, the
way a GPU replica owns its GPU, so a second replica adds capacity instead of oversubscribing the first's cores.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"
KEY = "ramp-key"
LONG_PROMPT = " ".join(f"clause {i} of the long contract under review" for i in range(60))  # ~480 tokens


def app_args(policy: str, threads: int | None) -> dict:
    engine = {"dtype": "float32", "num_kv_blocks": 48, "max_num_seqs": 16, "max_waiting": 64, "max_tokens_limit": 256,
              "num_threads": threads}
    return {"engine_config": engine, "api_key": KEY, "autoscaling_policy": policy, "num_cpus": 0.25, "min_replicas": 1,
            "max_replicas": 2, "target_ongoing_requests": 8, "upscale_delay_s": 5, "downscale_delay_s": 15,
            "look_back_period_s": 5}


def replicas() -> int:
    from ray import serve

    status = serve.status().applications.get("ramp")
    return status.deployments["EngineReplica"].replica_states.get("RUNNING", 0) if status else 0


class EngineSignals:
    """The latest engine stats of each replica, from a few handle calls a second (the router spreads them)."""

    def __init__(self):
        from ray import serve

        self.handle = serve.get_deployment_handle("EngineReplica", app_name="ramp")
        self.latest: dict[str, tuple[float, object]] = {}  # replica id -> (time seen, EngineStats)

    def poll(self, now: float, count: int) -> tuple[float, int, int]:
        """KV use (mean over the running replicas), waiting requests and preemptions so far (all replicas)."""
        for reply in [self.handle.stats.remote() for _ in range(2 * count)]:
            stats = reply.result(timeout_s=30)
            self.latest[stats.placement.replica_id] = (now, stats.engine)
        current = [engine for seen, engine in self.latest.values() if now - seen < 3][:max(count, 1)]
        preempted = sum(engine.num_preemptions for _, engine in self.latest.values())
        return (sum(e.kv_usage for e in current) / max(len(current), 1), sum(e.num_waiting for e in current),
                preempted)


async def closed_loop(client, url: str, users: int, until: float, body, ttfts: list, phase: str) -> None:
    async def user(i: int):
        while time.monotonic() < until:
            started = time.monotonic()
            async with client.stream("POST", url, json={**body(i), "stream": True},
                                     headers={"Authorization": f"Bearer {KEY}"}) as r:
                first = None
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic() - started
                ttfts.append((started, phase, first if r.status_code == 200 else None))
    await asyncio.gather(*(user(i) for i in range(users)))


async def ramp(base: str, short_s: float, long_s: float, quiet_s: float) -> tuple[list, list]:
    samples, ttfts, stop = [], [], threading.Event()
    signals = EngineSignals()
    t0 = time.monotonic()

    def sample():
        while not stop.is_set():
            count = replicas()
            samples.append((time.monotonic() - t0, count, *signals.poll(time.monotonic(), count)))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    url = base + "/v1/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        await closed_loop(client, url, 4, time.monotonic() + short_s,
                          lambda i: {"prompt": f"Say hello to user {i}.", "max_tokens": 32, "ignore_eos": True}, ttfts, "short")
        await closed_loop(client, url, 6, time.monotonic() + long_s,
                          lambda i: {"prompt": f"{i} {LONG_PROMPT}", "max_tokens": 64, "ignore_eos": True}, ttfts, "long")
    await asyncio.sleep(quiet_s)
    stop.set()
    sampler.join()
    return samples, [(s - t0, phase, ttft) for s, phase, ttft in ttfts]


def run_policy(policy: str, short_s: float, long_s: float, quiet_s: float, threads: int | None) -> dict:
    from ray import serve

    from loadtest.loopback import wait_healthy
    from serve_app.app import build_app

    serve.run(build_app(app_args(policy, threads)), name="ramp", route_prefix="/ramp", blocking=False)
    base = "http://127.0.0.1:8000/ramp"
    wait_healthy(base, 300)
    try:
        samples, ttfts = asyncio.run(ramp(base, short_s, long_s, quiet_s))
    finally:
        serve.delete("ramp")
    long_start = short_s
    out = [t for t, n, *_ in samples if t >= long_start and n >= 2]
    back = [t for t, n, *_ in samples if t >= short_s + long_s and n == 1]
    in_long = [s for s in samples if long_start <= s[0] < short_s + long_s]
    long_ttfts = sorted(x for _, phase, x in ttfts if phase == "long" and x is not None)
    return {"policy": policy, "samples": samples, "ttfts": ttfts,
            "scale_out_after_long_start_s": out[0] - long_start if out else None,
            "scale_in_after_load_s": back[0] - (short_s + long_s) if back else None,
            "long_ttft_p95_s": long_ttfts[int(0.95 * (len(long_ttfts) - 1))] if long_ttfts else None,
            "long_ttft_median_s": statistics.median(long_ttfts) if long_ttfts else None,
            "long_requests": len(long_ttfts), "failed": sum(1 for *_, x in ttfts if x is None),
            "long_waiting_mean": statistics.mean(s[3] for s in in_long) if in_long else None,
            "long_preemptions": in_long[-1][4] - in_long[0][4] if in_long else None}


def plot(results: list[dict], path: Path, short_s: float, long_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    for r in results:
        times = [s[0] for s in r["samples"]]
        for ax, column in zip(axes, (1, 2, 3)):
            ax.step(times, [s[column] for s in r["samples"]], where="post", label=r["policy"])
        axes[3].scatter([t for t, _, x in r["ttfts"] if x is not None], [x for *_, x in r["ttfts"] if x is not None],
                        s=6, label=r["policy"])
    for ax, label in zip(axes, ("running replicas", "KV pool use (mean)", "waiting requests", "time to first token (s)")):
        ax.axvspan(short_s, short_s + long_s, color="grey", alpha=0.15)
        ax.set_ylabel(label)
    axes[3].set_xlabel("seconds (shaded: the long-context phase)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)


def main(short_s: float = 30, long_s: float = 90, quiet_s: float = 45, policies: str = "requests,engine",
         threads: int | None = None):
    import ray
    from ray import serve

    from serve_app.ray_env import setdefault_ray_env

    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    setdefault_ray_env()
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    try:
        results = [run_policy(p, short_s, long_s, quiet_s, threads) for p in policies.split(",")]
    finally:
        serve.shutdown()
        ray.shutdown()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"autoscaling-ramp-{stamp}.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / f"autoscaling-ramp-{stamp}.png", short_s, long_s)
    table = Table(title=f"the same ramp under each policy, engine threads {threads or 'all'} ({short_s:.0f} s short chats, {long_s:.0f} s long contexts, "
                        f"{quiet_s:.0f} s quiet): autoscaling-ramp-{stamp}.png")
    for column in ("policy", "scale-out after the long phase starts", "back to 1 after the load", "long TTFT p50",
                   "long TTFT p95", "long requests", "waiting (long phase)", "preemptions (long phase)", "failed"):
        table.add_column(column, justify="right")
    fmt = lambda v: "never" if v is None else f"{v:.1f} s"  # noqa: E731
    for r in results:
        table.add_row(r["policy"], fmt(r["scale_out_after_long_start_s"]), fmt(r["scale_in_after_load_s"]),
                      fmt(r["long_ttft_median_s"]), fmt(r["long_ttft_p95_s"]), str(r["long_requests"]),
                      f"{r['long_waiting_mean']:.2f}", str(r["long_preemptions"]), str(r["failed"]))
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
