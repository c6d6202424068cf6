"""Where a graphed decode step's time goes, for gpu_check.py's missed goals: wall time of steps at one batch size
against the GPU's busy time in them, and the top CUDA kernels and host-side ops by time (torch's profiler).
`make gpu-check` runs it at its largest batch, with async scheduling and without, and sampled as chat clients ask
(temperature 0.8, top-p 0.95) with async scheduling; alone:

python benchmarks/gpu_step_profile.py --batch 256 --out benchmarks/results/gpu-profile
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import typer

from gpu_check import (  # the sibling script
    ROOT, SAMPLED, SIZES, _finish, _start, async_scheduling, build_model, engine_args, prompts, sync)

cli = typer.Typer(add_completion=False)


@cli.command()
def main(device: str = "cuda", batch: int = 256, steps: int = 8, eager: bool = False,
         ahead: bool = typer.Option(False, "--async-scheduling", help="launch each step before the one before it is read"),
         sampled: bool = typer.Option(False, help="temperature 0.8, top-p 0.95 rather than greedy"),
         out: Path = typer.Option(ROOT / "benchmarks" / "results" / "gpu-profile")):
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton defines a kernel, as gpu_check.py does
    import torch

    from engine import LLM

    sizes = SIZES[device]
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    args = engine_args(build_model(device, sizes, dtype, out), device, dtype, sizes)
    llm = LLM(**{**args, "max_num_seqs": max(batch, 8)}, enforce_eager=eager)
    result = profile_steps(llm, device, batch, steps, out, ahead, SAMPLED if sampled else None)
    print((out / result["file"]).read_text())


def profile_steps(llm, device: str, batch: int, steps: int, out: Path, ahead: bool, sampling: dict | None = None
                  ) -> dict:
    """`steps` decode steps of `batch` sequences under torch's profiler, after as many warm ones: the top kernels and
    host ops into profile-<batch>[-sampled][-async].txt under `out`; returns the step's wall and GPU-busy ms and its
    phases. `ahead`: with async scheduling; `sampling`: SamplingParams fields (greedy if None)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    engine, sizes = llm.engine, SIZES[device]
    ids = [f"profile-{i}" for i in range(batch)]
    with async_scheduling(llm, ahead):
        _start(llm, ids, prompts(batch, sizes.prompt_len, sizes.vocab_size, 5),
               SamplingParams(max_tokens=3 * steps + 64, ignore_eos=True, **(sampling or dict(temperature=0.0))))
        for _ in range(steps):  # warm
            llm.step()
        sync(device)
        phases = dict(engine.phases.seconds)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                llm.step()
            sync(device)
            wall = time.perf_counter() - started
        phases = {name: round(1e3 * (seconds - phases[name]) / steps, 3) for name, seconds in engine.phases.seconds.items()}
        _finish(llm, ids)
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps if device == "cuda" else None
    mode = ("eager" if engine.config.enforce_eager else "graphs") + (" + async scheduling" if ahead else "") + \
        (f", sampled {sampling}" if sampling else ", greedy")
    name = f"profile-{batch}{'-sampled' if sampling else ''}{'-async' if ahead else ''}.txt"
    lines = [f"batch {batch}, {mode}: {1e3 * wall / steps:.2f} ms a step (profiled), GPU busy "
             f"{'n/a' if gpu_ms is None else f'{gpu_ms:.2f}'} ms a step; phases, ms a step: {phases}",
             "top by device time:", events.table(sort_by="self_device_time_total", row_limit=15),
             "top by host time:", events.table(sort_by="self_cpu_time_total", row_limit=25)]
    (out / name).write_text("\n".join(lines))
    return {"batch": batch, "async_scheduling": ahead, "sampled": bool(sampling),
            "step_ms": round(1e3 * wall / steps, 3),
            "gpu_busy_ms": gpu_ms and round(gpu_ms, 3), "phases_ms": phases, "file": name}


if __name__ == "__main__":
    cli()
