"""make loadtest: Locust, headless, against a URL (or the embedded app, started here); a steady-state summary, plots,
and PASS/FAIL (exit code) against a req/h target and a p95 end-to-end SLO.

python -m loadtest.run --url http://127.0.0.1:8000 --users 32 --duration 600
python -m loadtest.run --url ... --rate 3.5 --arrival poisson        # open loop
python -m loadtest.run --url ... --sweep --rates 1,2,3,4,5           # find the knee
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from loadtest.loopback import wait_healthy
from loadtest.report import plot_run, plot_sweep, summarize
from serve_app.ray_env import ray_env, start_local_ray

app = typer.Typer(add_completion=False)
console = Console()
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run_locust(url: str, out: Path, label: str, users: int, rate: float, arrival: str, duration: float,
               max_tokens: int, stream_share: float, api_key: str, model: str) -> tuple[Path, float]:
    records = out / f"{label}-records.jsonl"
    user_class, count = ("OpenLoopUser", 1) if rate else ("ChatUser", users)
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url, "-u", str(count),
           "-r", str(count), "--run-time", f"{int(duration)}s", "--csv", str(out / label), "--csv-full-history",
           "--html", str(out / f"{label}.html"), "--only-summary", "--loglevel", "WARNING",
           "--max-tokens", str(max_tokens), "--stream-share", str(stream_share), "--records-file", str(records),
           "--rate", str(rate), "--arrival", arrival, user_class]
    env = dict(os.environ, LLM_SERVE_API_KEY=api_key) if api_key else None  # in the environment: a command line is public (ps)
    if model:
        cmd += ["--model", model]
    started = time.time()
    with open(out / f"{label}-locust.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        with tqdm(total=int(duration), desc=label, unit="s", bar_format="{desc}: {n_fmt}/{total_fmt} s |{bar}| {postfix}") as bar:
            while proc.poll() is None:
                time.sleep(1)
                bar.n = min(int(time.time() - started), int(duration))
                bar.set_postfix_str(f"{_count_lines(records)} requests done")
    return records, started


def _count_lines(path: Path) -> int:
    return sum(1 for _ in open(path)) if path.exists() else 0


def load_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path)] if path.exists() else []


@contextlib.contextmanager
def embedded_app(port: int = 8000, throughput: bool = True, args: dict | None = None):
    """Ray on loopback with a fixed metrics port (as `make serve`), then the embedded app; torn down afterwards.
    throughput: Ray Serve's high-throughput mode, as make serve (serve_app/ray_env.py); False: Serve's Python proxy,
    on a Ray started here. args: AppArgs fields laid over serve_app/config.yaml's (a copy of it, in a temporary
    directory)."""
    started_ray = start_local_ray(throughput)  # as make serve
    with tempfile.TemporaryDirectory() as scratch:
        config = ROOT / "serve_app/config.yaml"
        if args:
            settings = yaml.safe_load(config.read_text())
            settings["applications"][0]["args"].update(args)
            config = Path(scratch) / "config.yaml"
            config.write_text(yaml.safe_dump(settings))
        proc = subprocess.Popen([str(BIN / "serve"), "run", "--address", "auto", str(config)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **ray_env(throughput)})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, 600, proc, "the embedded app")
            yield url
        finally:
            proc.terminate()
            proc.wait(60)
            if started_ray:
                subprocess.run([str(BIN / "ray"), "stop"], capture_output=True)


def print_summary(s: dict) -> None:
    table = Table(title=f"{s['label']}: {s['requests_ok']} ok, {s['requests_failed']} failed over a {s['window_s']:.0f} s steady state")
    for column in ("metric", "p50", "p90", "p95", "p99"):
        table.add_column(column, justify="right")
    for key, name in (("e2e", "e2e latency (s)"), ("ttft", "TTFT (s)"), ("itl", "ITL (s)")):
        q = s[key]
        table.add_row(name, *(f"{q[p]:.3f}" if q[p] is not None else "-" for p in ("p50", "p90", "p95", "p99")))
    console.print(table)
    console.print(f"achieved: [bold]{s['achieved_rph']:,.0f} req/h[/bold], {s['output_tokens_per_s']:.0f} output tok/s; "
                  f"errors: {s['errors'] or 'none'}")


@app.command()
def main(
    url: str = typer.Option("", help="server to load; empty: start the embedded app here (as make serve)"),
    users: int = typer.Option(32, help="closed loop: concurrent users"),
    rate: float = typer.Option(0.0, help="open loop: arrivals per second (overrides --users)"),
    arrival: str = typer.Option("poisson", help="open loop: poisson | fixed"),
    duration: float = typer.Option(600, help="seconds per run (a sweep: per step)"),
    warmup: float = typer.Option(60, help="seconds excluded from the steady state at the start of each run"),
    sweep: bool = typer.Option(False, help="open-loop runs at --rates; report the knee"),
    rates: str = typer.Option("1,2,3,4,5,6", help="sweep: arrival rates in req/s"),
    max_tokens: int = 128,
    stream_share: float = 0.75,
    target_rph: float = typer.Option(10000, help="PASS needs at least this many requests/hour"),
    p95_e2e_slo: float = typer.Option(30.0, help="PASS needs p95 end-to-end latency under this (s)"),
    api_key: str = typer.Option("", envvar="LLM_SERVE_API_KEY"),
    model: str = typer.Option("", help="model field to send (vLLM needs it); several, comma-separated, in turn"),
    prometheus: str = typer.Option("http://127.0.0.1:9090", help="if reachable, server-side plots come from it"),
    label: str = typer.Option("engine", help="name of this server in tables and files"),
    throughput_mode: bool = typer.Option(True, help="the embedded app in Ray Serve's high-throughput mode (HAProxy, "
                                         "gRPC), as make serve; --no-throughput-mode: Serve's Python proxy"),
    out_dir: Path = Path("loadtest/reports"),
):
    out = out_dir / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if not url:
            url = stack.enter_context(embedded_app(throughput=throughput_mode))
        common = dict(max_tokens=max_tokens, stream_share=stream_share, api_key=api_key, model=model)
        if sweep:
            passed = run_sweep(url, out, label, [float(r) for r in rates.split(",")], arrival, duration, warmup,
                               target_rph, p95_e2e_slo, common)
        else:
            passed = run_once(url, out, label, users, rate, arrival, duration, warmup, target_rph, p95_e2e_slo,
                              prometheus, common)
    console.print(f"report: {out}")
    console.print("[bold green]PASS[/bold green]" if passed else "[bold red]FAIL[/bold red]")
    raise typer.Exit(0 if passed else 1)


def run_once(url, out, label, users, rate, arrival, duration, warmup, target_rph, slo, prometheus, common) -> bool:
    records_path, started = run_locust(url, out, label, users, rate, arrival, duration, **common)
    records = load_records(records_path)
    s = summarize(records, started + warmup, started + duration, label)
    s.update(url=url, mode=f"open loop {rate}/s {arrival}" if rate else f"closed loop, {users} users",
             duration_s=duration, warmup_s=warmup, target_rph=target_rph, p95_e2e_slo_s=slo)
    s["pass"] = (s["requests_ok"] > 0 and s["requests_failed"] == 0 and s["achieved_rph"] >= target_rph
                 and s["e2e"]["p95"] is not None and s["e2e"]["p95"] <= slo)
    plot_run(records, started, started + duration, warmup, out, prometheus)
    (out / "summary.json").write_text(json.dumps(s, indent=2))
    print_summary(s)
    return s["pass"]


def run_sweep(url, out, label, rates, arrival, duration, warmup, target_rph, slo, common) -> bool:
    steps = []
    for r in rates:
        records_path, started = run_locust(url, out, f"{label}-{r:g}rps", 0, r, arrival, duration, **common)
        s = summarize(load_records(records_path), started + warmup, started + duration, f"{label} @ {r:g} req/s")
        s["offered_rph"] = r * 3600
        s["meets_slo"] = (s["requests_failed"] == 0 and s["e2e"]["p95"] is not None and s["e2e"]["p95"] <= slo
                          and s["achieved_rph"] >= 0.9 * s["offered_rph"])
        steps.append(s)
        console.print(f"{r:g} req/s: achieved {s['achieved_rph']:,.0f} req/h, p95 e2e "
                      f"{s['e2e']['p95'] if s['e2e']['p95'] is not None else float('nan'):.1f} s, "
                      f"{s['requests_failed']} failed -> {'meets' if s['meets_slo'] else 'misses'} the SLO")
        saturated = s["achieved_rph"] < 0.7 * s["offered_rph"] or (s["e2e"]["p95"] or 0) > 2 * slo
        if not s["meets_slo"] and saturated:
            break  # far past the knee: more load only queues
    good = [s for s in steps if s["meets_slo"]]
    knee = max(good, key=lambda s: s["achieved_rph"]) if good else None
    result = {"label": label, "url": url, "p95_e2e_slo_s": slo, "target_rph": target_rph, "steps": steps,
              "knee_rph": knee["achieved_rph"] if knee else 0.0, "knee_offered_rph": knee["offered_rph"] if knee else 0.0}
    (out / "sweep.json").write_text(json.dumps(result, indent=2))
    plot_sweep(steps, slo, out / "sweep.png", label)
    table = Table(title=f"{label}: sweep, p95 e2e SLO {slo:g} s")
    for column in ("offered req/h", "achieved req/h", "p50 e2e", "p95 e2e", "p95 TTFT", "out tok/s", "failed", "SLO"):
        table.add_column(column, justify="right")
    for s in steps:
        f = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        table.add_row(f"{s['offered_rph']:,.0f}", f"{s['achieved_rph']:,.0f}", f(s["e2e"]["p50"]), f(s["e2e"]["p95"]),
                      f(s["ttft"]["p95"]), f"{s['output_tokens_per_s']:.0f}", str(s["requests_failed"]),
                      "meets" if s["meets_slo"] else "misses")
    console.print(table)
    console.print(f"knee: [bold]{result['knee_rph']:,.0f} req/h[/bold] within p95 {slo:g} s")
    return result["knee_rph"] >= target_rph


if __name__ == "__main__":
    app()
