"""Host time of a decode step: the engine core's own Python around the forward (scheduling, input preparation, the
sampler's bookkeeping, committing tokens), by batch size, on a one-layer model whose forward costs little. On a GPU
that time is the GPU's idle time, unless async scheduling overlaps it (the first H100 run: ~5 of a 9.8 ms batch-256
step). Phases come from the engine's own PhaseTimer; "host" is the step's wall time less its forward. Steps run
through `LLM.step()`, as `generate`'s do, and "front_end" is its time in the output processor (detokenizing), which an
inline core spends between its steps; "step" is the core's alone. Medians of several rounds; requests report once,
at the end, as `generate`'s do. `--graph-buffers`: decode steps through the CUDA graphs' input buffers (run eagerly
here) with the replay itself stubbed to a constant hidden state, so "step" is what a GPU's host does around each
replay, steps ahead advancing the buffers on the device included. `--sampled`: every request at temperature 0.7 and
top-p 0.9, as chat clients ask, instead of greedy.

python benchmarks/step_host.py --batches 1,32,128,256 --out benchmarks/results/step-host.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cpu_flags  # noqa: E402  the sibling scripts
from gpu_check import SIZES, build_model, prompts  # noqa: E402

cli = typer.Typer(add_completion=False)
# one layer of width 64: the forward is ~1 ms at batch 256 on a CPU core, so the host's own work shows
TINY = dict(SIZES["cpu"].model, num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=1,
            num_key_value_heads=1)


def measure(batch: int, ahead: bool, rounds: int, steps: int, path: str, graph_buffers: bool = False,
            sampled: bool = False) -> dict:
    from engine import LLM, SamplingParams
    from engine.step_stats import heap_frozen_during

    llm = LLM(model=path, device="cpu", dtype="float32", max_num_seqs=batch, max_num_batched_tokens=4096,
              num_kv_blocks=max(64, batch * (rounds * steps + 64) // 16 + 64))
    engine = llm.engine
    if ahead:
        engine.async_scheduling = True
    if graph_buffers:
        engine.runner.num_splits_for = lambda *_: 1  # the Triton kernel's rule; no attention runs in the stubbed replay
        graphs = engine.runner.capture_graphs(batch, engine.max_model_len, capture=False)
        hidden = torch.zeros(graphs.max_batch, TINY["hidden_size"])
        graphs._forward = lambda b: hidden[:b]  # the replay: the GPU's time, not the host's
    # sampled: as chat clients ask (temperature and top-p), each request its own params
    knobs = dict(temperature=0.7, top_p=0.9) if sampled else dict(temperature=0.0)
    params = [SamplingParams(max_tokens=rounds * steps + 40, ignore_eos=True, **knobs) for _ in range(batch)]
    for i, prompt in enumerate(prompts(batch, 32, SIZES["cpu"].vocab_size, 1)):
        llm.add_request(f"r{i}", prompt, params[i], final_only=True)
    for _ in range(10):  # prefill, and the first decode steps
        llm.step()
    results = []
    with heap_frozen_during():  # as generate() steps: a full collection of the old heap is not the step's own work
        for _ in range(rounds):
            before, front_end, started = dict(engine.phases.seconds), llm.front_end_seconds, time.perf_counter()
            for _ in range(steps):
                llm.step()
            front_end = (llm.front_end_seconds - front_end) / steps
            wall = (time.perf_counter() - started) / steps - front_end
            phases = {k: (v - before[k]) / steps for k, v in engine.phases.seconds.items()}
            results.append({**phases, "step": wall, "host": wall - phases["forward"], "front_end": front_end})
    return {"batch": batch, "async_scheduling": ahead, "graph_buffers": graph_buffers, "sampled": sampled,
            **{k: round(1e3 * statistics.median(r[k] for r in results), 3) for k in results[0]}}


@cli.command()
def main(batches: str = "1,32,128,256", rounds: int = 7, steps: int = 60, both: bool = True,
         graph_buffers: bool = False, sampled: bool = False, out: Path | None = None):
    """Writes rows of milliseconds per step: host (wall less forward), each phase, and the whole step."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / "step-host-model"
    sizes = SIZES["cpu"]
    sizes.model = TINY
    path = build_model("cpu", sizes, torch.float32, workdir)
    torch.set_num_threads(1)
    cases = [(int(b), ahead) for b in batches.split(",") for ahead in ((False, True) if both else (False,))]
    rows = [measure(b, ahead, rounds, steps, path, graph_buffers, sampled)
            for b, ahead in tqdm(cases, desc="batches", unit="case")]
    table = Table(title="decode step, ms (median of rounds)")
    columns = ("batch", "async_scheduling", "sampled", "host", "schedule", "prepare", "forward", "sample", "output",
               "step", "front_end")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    Console().print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_flags(), "torch_threads": 1, "rows": rows}, indent=2))


if __name__ == "__main__":
    cli()
