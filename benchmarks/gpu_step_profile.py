"""Where a graphed decode step's time goes, for gpu_check.py's missed goals: wall time of steps at one batch size
against the GPU's busy time in them, and the top CUDA kernels and host-side ops by time (torch's profiler).

python benchmarks/gpu_step_profile.py --batch 256 --out benchmarks/results/gpu-profile
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import typer

from gpu_check import ROOT, SIZES, _finish, _start, build_model, prompts, sync  # the sibling script

cli = typer.Typer(add_completion=False)


@cli.command()
def main(device: str = "cuda", batch: int = 256, steps: int = 8, eager: bool = False,
         async_scheduling: bool = typer.Option(False, help="launch each step before the one before it is read"),
         out: Path = typer.Option(ROOT / "benchmarks" / "results" / "gpu-profile")):
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton defines a kernel, as gpu_check.py does
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    sizes = SIZES[device]
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    llm = LLM(model=build_model(device, sizes, dtype, out), device=device, dtype=str(dtype).removeprefix("torch."),
              max_num_seqs=max(batch, 8), max_num_batched_tokens=sizes.max_num_batched_tokens,
              num_kv_blocks=sizes.num_kv_blocks, enforce_eager=eager, attention_backend="triton")
    llm.engine.async_scheduling = async_scheduling
    ids = [f"p{i}" for i in range(batch)]
    _start(llm, ids, prompts(batch, sizes.prompt_len, sizes.vocab_size, 5),
           SamplingParams(max_tokens=3 * steps + 64, temperature=0.0, ignore_eos=True))
    for _ in range(steps):  # warm
        llm.step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            llm.step()
        sync(device)
        wall = time.perf_counter() - started
    _finish(llm, ids)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) if device == "cuda" else 0.0
    mode = ("eager" if eager else "graphs") + (" + async scheduling" if async_scheduling else "")
    lines = [f"batch {batch}, {mode}: {1e3 * wall / steps:.2f} ms a step (profiled), "
             f"GPU busy {gpu_us / 1e3 / steps:.2f} ms a step; phases {llm.engine.stats().step_seconds}",
             "top by device time:", events.table(sort_by="self_device_time_total", row_limit=15),
             "top by host time:", events.table(sort_by="self_cpu_time_total", row_limit=25)]
    (out / f"profile-{batch}{'-async' if async_scheduling else ''}.txt").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    cli()
