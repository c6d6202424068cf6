"""Soak (make soak): the app under the load-test mix at a steady open-loop rate for a long time, reported per minute:
req/h, p95 end-to-end latency and failures from Locust's records; step rate, tokens a step, step time by phase, GC
pauses and resident memory from the replica's metrics in Prometheus (`make observe`). PASS when, in the last 5 minutes
against minutes 2-7, steps of the same size take within 5% of the time (the step rate itself follows the batch,
which open-loop arrivals swing) and req/h stays within 5%, resident memory grows under 10%, and nothing failed.

python benchmarks/soak.py --rate 0.5 --duration 1800      # set --rate to about 80% of the knee on your machine
python benchmarks/soak.py --users 40 --duration 1800     # closed loop: a steady batch
"""
from __future__ import annotations

import contextlib
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from engine.step_stats import PHASES
from loadtest.report import finish
from loadtest.run import embedded_app, load_records, run_locust

cli = typer.Typer(add_completion=False)
console = Console(width=160)
MINUTE = 60.0
LOCUST_REPORTS = Path("loadtest/reports")
SERVER = {
    "steps/s": "sum(rate(ray_engine_steps_total[1m]))",
    "tokens/step": "sum(rate(ray_engine_iteration_tokens_sum[1m])) / sum(rate(ray_engine_iteration_tokens_count[1m]))",
    **{f"{phase} ms/step": f'sum(rate(ray_engine_step_phase_seconds_total{{phase="{phase}"}}[1m])) * 1000 '
                           f"/ sum(rate(ray_engine_steps_total[1m]))" for phase in PHASES},
    "GC %": "sum(rate(ray_engine_gc_pause_seconds_total[1m])) * 100",
    "RSS MiB": "max(ray_engine_resident_memory_bytes) / 2^20",
}


def client_minutes(records: list[dict], start: float, minutes: int) -> list[dict]:
    """req/h, p95 end-to-end latency and failures of the requests that finished in each minute."""
    rows = []
    for m in range(minutes):
        lo, hi = start + m * MINUTE, start + (m + 1) * MINUTE
        done = [r for r in records if lo <= finish(r) < hi]
        ok = [r["e2e"] for r in done if r["ok"]]
        rows.append({"req/h": len(ok) * 60, "p95 s": float(np.percentile(ok, 95)) if ok else float("nan"),
                     "failed": len(done) - len(ok)})
    return rows


def server_minutes(prometheus: str, start: float, minutes: int) -> list[dict]:
    """Each SERVER query at the end of each minute (its 1-minute rate covers that minute)."""
    rows = [dict.fromkeys(SERVER, float("nan")) for _ in range(minutes)]
    for name, expr in SERVER.items():
        r = httpx.get(f"{prometheus}/api/v1/query_range", timeout=30,
                      params={"query": expr, "start": start + MINUTE, "end": start + minutes * MINUTE, "step": MINUTE})
        r.raise_for_status()
        for series in r.json()["data"]["result"][:1]:
            for t, value in series["values"]:
                rows[round((float(t) - start) / MINUTE) - 1][name] = float(value)
    return rows


def step_time_drift(early: list[dict], late: list[dict]) -> float:
    """How much slower the late steps are than early steps of the same size: open-loop arrivals swing the batch, and
    the step rate follows the batch (a step of 60 tokens takes longer than one of 20), so the late minutes' step time
    is compared with a line through the early minutes' (ms/step against tokens/step). Median ratio, minus 1."""
    tokens = np.array([r["tokens/step"] for r in early])
    ms = np.array([1000 / r["steps/s"] for r in early])
    flat = np.ptp(tokens) <= 0.5  # a batch that never moved gives no slope to fit: compare with its median step
    slope, intercept = (0.0, float(np.median(ms))) if flat else np.polyfit(tokens, ms, 1)
    return float(statistics.median((1000 / r["steps/s"]) / (intercept + slope * r["tokens/step"]) for r in late)) - 1


def verdict(rows: list[dict]) -> dict:
    """The last 5 minutes against minutes 2-7 (the first is warm-up); needs at least 12 minutes."""
    early, late = rows[1:7], rows[-5:]

    def change(key: str) -> float:
        return statistics.median(r[key] for r in late) / statistics.median(r[key] for r in early) - 1

    out = {"step_rate_change": change("steps/s"), "tokens_per_step_change": change("tokens/step"),
           "step_time_drift": step_time_drift(early, late), "rph_change": change("req/h"),
           "rss_growth": change("RSS MiB"), "failed": sum(r["failed"] for r in rows)}
    out["pass"] = (abs(out["step_time_drift"]) <= 0.05 and abs(out["rph_change"]) <= 0.05 and out["rss_growth"] < 0.10
                   and out["failed"] == 0)
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = np.arange(1, len(rows) + 1)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    series = [(axes[0, 0], ["req/h"], "requests/hour"), (axes[0, 1], ["p95 s"], "p95 end-to-end latency (s)"),
              (axes[1, 0], [f"{p} ms/step" for p in PHASES], "step time by phase (ms)"), (axes[1, 1], ["RSS MiB"], "resident MiB")]
    for ax, keys, label in series:
        for key in keys:
            ax.plot(minutes, [r[key] for r in rows], marker=".", label=key)
        ax.set(xlabel="minute", ylabel=label)
        ax.grid(alpha=0.3)
    twin = axes[0, 0].twinx()
    twin.plot(minutes, [r["steps/s"] for r in rows], color="gray", linestyle="--", label="steps/s")
    twin.set_ylabel("engine steps/s")
    axes[1, 0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@cli.command()
def main(rate: float = typer.Option(0.5, help="open-loop arrivals per second: about 80% of `make loadtest --sweep`'s knee"),
         users: int = typer.Option(0, help="closed loop instead: this many users, each sending its next request when "
                                           "the last ends (a steady batch, so the raw step rate shows drift too)"),
         duration: float = typer.Option(1800, help="seconds; at least 12 minutes for a verdict"),
         url: str = typer.Option("", help="server to load; empty: start the embedded app here (as make serve)"),
         prometheus: str = typer.Option("http://127.0.0.1:9090", help="scraping the app's metrics (make observe)"),
         max_tokens: int = 128, api_key: str = typer.Option("", envvar="LLM_SERVE_API_KEY"),
         out_dir: Path = Path("benchmarks/results")):
    httpx.get(f"{prometheus}/-/ready", timeout=5).raise_for_status()  # no server-side half of the report without it
    stamp = f"soak-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    locust_dir = LOCUST_REPORTS / stamp  # Locust's raw CSVs, HTML and records, kept out of git as make loadtest's are
    locust_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        url = url or stack.enter_context(embedded_app())
        records_path, started = run_locust(url, locust_dir, "soak", users, 0 if users else rate, "poisson", duration,
                                           max_tokens=max_tokens, stream_share=0.75, api_key=api_key, model="")
    minutes = int(duration // MINUTE)
    rows = [{"minute": m + 1, **c, **s} for m, (c, s) in enumerate(zip(client_minutes(load_records(records_path), started, minutes),
                                                                          server_minutes(prometheus, started, minutes)))]
    result = verdict(rows) if minutes >= 12 else {"pass": None}
    load = f"{users} users" if users else f"{rate:g} req/s"
    report(rows, result, out_dir / stamp, f"soak at {load} for {duration / 60:.0f} min")
    raise typer.Exit(0 if result["pass"] in (True, None) else 1)


def report(rows: list[dict], result: dict, out: Path, title: str) -> None:
    """The table on the console; `out`.json and `out`.png."""
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key, justify="right")
    for r in rows:
        table.add_row(*(f"{v:,.2f}" if isinstance(v, float) else str(v) for v in r.values()))
    console.print(table)
    console.print(result)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "verdict": result}, indent=2))
    plot(rows, out.with_suffix(".png"), title)
    console.print(f"wrote {out}.json and .png")


if __name__ == "__main__":
    cli()
