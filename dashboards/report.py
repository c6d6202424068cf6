"""Renders the overview dashboard's main panels as one PNG from Prometheus query_range data.

python -m dashboards.report --prometheus http://127.0.0.1:9090 --minutes 15 --out docs/dashboard.png
"""
from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import typer  # noqa: E402

from dashboards.build import render as render_dashboards  # noqa: E402

app = typer.Typer(add_completion=False)
MAIN_PANELS = ["Requests/s by HTTP status", "End-to-end latency", "Time to first token", "Inter-token latency",
               "Tokens/s", "Running and waiting requests", "KV cache usage", "Prefix-cache hit rate", "Replicas"]
UNIT_LABELS = {"reqps": "requests/s", "s": "seconds", "short": "", "percentunit": "share"}


def panels_with_queries() -> list[dict]:
    model = json.loads(render_dashboards()["overview.json"])
    return [p for p in model["panels"] if p.get("title") in MAIN_PANELS]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    r = httpx.get(prometheus + "/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def legend(template: str, labels: dict) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def substitute(expr: str, rate_window: str, model_name: str = ".*", replica: str = ".*") -> str:
    """What Grafana does to a panel's expression before it queries Prometheus."""
    return (expr.replace("$__rate_interval", rate_window).replace('"$model_name"', f'"{model_name}"')
            .replace('"$replica"', f'"{replica}"'))


def render(prometheus: str, start: float, end: float, out: Path, model_name: str = ".*", title: str = "") -> Path:
    panels = panels_with_queries()
    step = max(1.0, (end - start) / 300)
    rate_window = f"{max(15, int(step * 4))}s"
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.4 * rows), squeeze=False)
    for ax, p in zip(axes.flat, panels):
        for target in p["targets"]:
            for series in query_range(prometheus, substitute(target["expr"], rate_window, model_name), start, end, step):
                xs = [datetime.fromtimestamp(float(t)) for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]) or None)
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        ax.set_title(p["title"])
        ax.set_ylabel(UNIT_LABELS.get(unit, unit))
        ax.set_xlabel("time")
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title or f"LLM serving overview, {datetime.fromtimestamp(start):%Y-%m-%d %H:%M}-{datetime.fromtimestamp(end):%H:%M}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


@app.command()
def main(prometheus: str = "http://127.0.0.1:9090", minutes: float = 15, out: Path = Path("docs/dashboard.png"),
         model_name: str = ".*"):
    end = time.time()
    path = render(prometheus, end - minutes * 60, end, out, model_name)
    print(f"wrote {path}")


if __name__ == "__main__":
    app()
