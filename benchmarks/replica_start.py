"""How long an engine replica takes to start, from a fresh Python process: what an autoscaler's new replica waits for
before its first request (Ray Serve adds its own actor start around it). Each run is a new interpreter that imports
the front end, builds `AsyncLLMEngine` with the core in its own process (the core loads and warms the model, then
answers ready) and warms the front end, as serve_app/replica.py does; phases are timed in the child, the total from
the parent's spawn to the child's report. Medians of several runs.

python benchmarks/replica_start.py --runs 5 --out benchmarks/results/replica-start.json
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import cpu_flags  # noqa: E402  the sibling script

cli = typer.Typer(add_completion=False)
PHASES = ("imports", "core_ready", "front_end_warm_up", "total")
CHILD = """
import json, sys, time
started = time.perf_counter()
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
imported = time.perf_counter()
engine = AsyncLLMEngine(EngineConfig.model_validate_json(sys.argv[1]))
ready = time.perf_counter()
engine.warm_up()
warm = time.perf_counter()
print(json.dumps({"imports": imported - started, "core_ready": ready - imported, "front_end_warm_up": warm - ready}),
      flush=True)
engine.shutdown()
"""


def one_start(config_json: str) -> dict[str, float]:
    spawned = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, config_json], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    total = time.perf_counter() - spawned
    if child.wait(timeout=120) != 0 or not line:
        raise RuntimeError(f"the replica start failed (exit {child.returncode})")
    return {**json.loads(line), "total": total}


@cli.command()
def main(runs: int = 5, config: str = typer.Option("{}", help="EngineConfig fields as JSON (engine_process is on)"),
         out: Path | None = None):
    from engine.config import EngineConfig

    config_json = EngineConfig.model_validate({**json.loads(config), "engine_process": True}).model_dump_json()
    starts = [one_start(config_json) for _ in tqdm(range(runs), desc="replica starts")]
    medians = {phase: statistics.median(start[phase] for start in starts) for phase in PHASES}
    table = Table(title=f"A replica's start, median of {runs} (seconds)")
    for phase in PHASES:
        table.add_column(phase, justify="right")
    table.add_row(*(f"{medians[phase]:.2f}" for phase in PHASES))
    Console().print(table)
    if out:
        out.write_text(json.dumps({"cpu_flags": cpu_flags(), "config": json.loads(config_json), "runs": starts,
                                   "medians": medians}, indent=1))


if __name__ == "__main__":
    cli()
