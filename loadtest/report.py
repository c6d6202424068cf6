"""Load-test records -> steady-state summary and PNG plots."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PERCENTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}
BIN_S = 10


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {k: None for k in PERCENTILES}
    return {k: float(np.percentile(values, q)) for k, q in PERCENTILES.items()}


def finish(r: dict) -> float:
    return r["start"] + r["e2e"]


def summarize(records: list[dict], window_start: float, window_end: float, label: str) -> dict:
    """Requests that finished inside the window count; failures count over the whole run (warm-up included)."""
    steady = [r for r in records if window_start <= finish(r) <= window_end]
    ok = [r for r in steady if r["ok"]]
    window = max(1e-9, window_end - window_start)
    return {
        "label": label,
        "window_s": window,
        "requests_ok": len(ok),
        "requests_failed": sum(1 for r in records if not r["ok"]),
        "errors": dict(Counter(r["reason"] for r in records if not r["ok"])),
        "achieved_rph": len(ok) / window * 3600,
        "output_tokens_per_s": sum(r["completion_tokens"] for r in ok) / window,
        "mean_completion_tokens": float(np.mean([r["completion_tokens"] for r in ok])) if ok else 0.0,
        "e2e": percentiles([r["e2e"] for r in ok]),
        "ttft": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl": percentiles([r["itl"] for r in ok if r["itl"] is not None]),
    }


def _bins(records: list[dict], start: float, end: float):
    edges = np.arange(start, end + BIN_S, BIN_S)
    groups = [[r for r in records if r["ok"] and lo <= finish(r) < lo + BIN_S] for lo in edges[:-1]]
    minutes = (edges[:-1] + BIN_S / 2 - start) / 60
    return minutes, groups


def plot_run(records: list[dict], start: float, end: float, warmup: float, out: Path, prometheus: str = "") -> list[Path]:
    minutes, groups = _bins(records, start, end)
    paths = []

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(minutes, [len(g) / BIN_S * 3600 for g in groups], label="completed req/h")
    ax.set_xlabel("minutes since start")
    ax.set_ylabel("requests / hour")
    ax2 = ax.twinx()
    ax2.plot(minutes, [sum(r["completion_tokens"] for r in g) / BIN_S for g in groups], color="tab:orange", label="output tok/s")
    ax2.set_ylabel("output tokens / s")
    ax.axvspan(0, warmup / 60, color="grey", alpha=0.15, label="warm-up (excluded)")
    fig.legend(loc="lower right")
    ax.set_title(f"Throughput per {BIN_S} s")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "throughput.png"))

    fig, ax = plt.subplots(figsize=(9, 4))
    for key, q, style in (("e2e", 50, "-"), ("e2e", 95, "-"), ("ttft", 50, "--"), ("ttft", 95, "--")):
        ys = [np.percentile([r[key] for r in g if r[key] is not None], q) if any(r[key] is not None for r in g) else np.nan
              for g in groups]
        ax.plot(minutes, ys, style, label=f"{key.upper()} p{q}")
    ax.axvspan(0, warmup / 60, color="grey", alpha=0.15, label="warm-up (excluded)")
    ax.set_xlabel("minutes since start")
    ax.set_ylabel("seconds")
    ax.set_title(f"Latency percentiles per {BIN_S} s (by finish time)")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "latency.png"))

    if prometheus and _reachable(prometheus):
        from dashboards.report import render

        paths.append(render(prometheus, start, end, out / "server.png", title="Server side (Prometheus)"))
    return paths


def plot_sweep(steps: list[dict], slo: float, path: Path, label: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    offered = [s["offered_rph"] for s in steps]
    ax.plot(offered, [s["e2e"]["p95"] or np.nan for s in steps], "o-", label="p95 e2e")
    ax.plot(offered, [s["e2e"]["p50"] or np.nan for s in steps], "o--", label="p50 e2e")
    ax.axhline(slo, color="red", linestyle=":", label=f"SLO {slo:g} s")
    ax.set_xlabel("offered load (requests / hour)")
    ax.set_ylabel("latency (s)")
    ax.set_title(f"{label}: latency against load")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _reachable(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
