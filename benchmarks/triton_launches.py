"""Triton kernels launched in one decode step, by kernel, counted on any machine: a tiny Qwen2 on the Triton backend
(on CPU under triton's interpreter), every `Launch.run` of one step after a few warm ones. How a change to the GPU
step's kernel count is checked before a GPU's profiler counts it (`make gpu-check`'s `kernels_per_step`).

python benchmarks/triton_launches.py
"""
from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton defines a kernel

cli = typer.Typer(add_completion=False)


def launches_per_decode_step(batch: int) -> tuple[Counter, int]:
    """-> (launches by kernel name, the model's layers)."""
    import torch

    from engine import LLM, SamplingParams
    from engine.kernels.triton import launch
    from tests.fixtures.tiny_models import tiny_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    checkpoint = tiny_checkpoint(Path(tempfile.mkdtemp()), "qwen2-hd128")
    llm = LLM(model=checkpoint, dtype="float32", device=device, attention_backend="triton", num_kv_blocks=64,
              max_num_seqs=batch, enforce_eager=True)
    for i in range(batch):
        llm.add_request(f"r{i}", [5 + i, 17, 300, 42], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # the prefill, then decode steps
        llm.step()
    counts: Counter = Counter()
    run = launch.Launch.run

    def counted(self):
        counts[getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__] += 1
        return run(self)

    launch.Launch.run = counted
    try:
        llm.step()
    finally:
        launch.Launch.run = run
    while llm.has_unfinished_requests():  # to their ends: every KV block back in the pool
        llm.step()
    return counts, llm.engine.model.config.num_hidden_layers


@cli.command()
def main(batch: int = 4):
    counts, layers = launches_per_decode_step(batch)
    print(f"{sum(counts.values())} Triton launches in a decode step of {batch} on {layers} layers: {dict(counts)}")


if __name__ == "__main__":
    cli()
