"""Where one decode step's time goes: in the core, linear layers, attention, other model ops, sampler, scheduler and the
rest of its step; then the front end's output processing (detokenizing, stop strings), at a steady decode batch, for
each model implementation in the same run. `llm.step()` is both: the core's step, then the front end's.

Each phase is timed by wrapping its function with a clock (no profiler: its per-op overhead would swamp the small
ops this is meant to show). python benchmarks/step_phases.py --batch 64 --context 200 --impls native,hf,gguf
An impl ending in `+compile` runs `compile: true`; its layers are one graph, so only its model total is split out.
A decode step runs every layer in one native call where it can (`LlamaModel.use_native_decode`): that call is its
own phase, since its linears and attention run in C++; an impl ending in `+layered` turns it off, to split them.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import trange

import engine.detokenizer
import engine.layers.linear
import engine.models.hf
import engine.models.llama
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from core_env import restart_as_served  # the sibling script

cli = typer.Typer(add_completion=False)
PHASES = ["core step", "linear", "attention", "one-call layers", "other model ops", "sampler", "scheduler",
          "rest of core step", "front end: outputs", "of which detokenizer"]


class PhaseClock:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, phase: str):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
        setattr(owner, name, timed)
        return original


@contextmanager
def instrumented(llm: LLM, clock: PhaseClock):
    llm_engine = llm.engine
    targets = [(llm_engine.runner, "execute", "model"), (llm_engine, "sampler", "sampler"),
               (engine.detokenizer.IncrementalDetokenizer, "add", "detokenizer"),
               (engine.detokenizer.ByteLevelDetokenizer, "add", "detokenizer"),
               (llm_engine.scheduler, "schedule", "scheduler"), (llm.outputs, "process", "front end")]
    if not llm_engine.config.compile:  # a clock inside a compiled graph would break it
        targets += [(torch.nn.Linear, "forward", "linear"), (engine.layers.linear.Linear, "forward", "linear"),
                    (engine.models.llama, "paged_attention", "attention"),
                    (engine.models.hf, "paged_attention", "attention")]
        decoder = getattr(llm_engine.model, "model", None)  # the native model's LlamaModel; the HF wrapper has none
        fused = getattr(decoder, "fused", None)
        if fused is not None:
            targets.append((fused, "decode_layers", "one-call layers"))
    originals = [(owner, name, clock.wrap(owner, name, phase)) for owner, name, phase in targets]
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def decode_batch(impl: str, dtype: str, threads: int, batch: int, context: int, model: str | None = None) -> LLM:
    """impl: native, hf, or gguf (the native model on the embedded GGUF's blocks), then "+compile" or "+layered";
    `model`: a checkpoint instead of the embedded model."""
    layered, impl = impl.endswith("+layered"), impl.removesuffix("+layered")
    impl, compiled = impl.removesuffix("+compile"), impl.endswith("+compile")
    weights = {"model_impl": "native", "quantization": "gguf"} if impl == "gguf" else {"model_impl": impl}
    weights |= {"model": model} if model else {}
    llm = LLM(config=EngineConfig(**weights, compile=compiled, dtype=dtype, num_threads=threads, max_num_seqs=batch,
                                  max_num_batched_tokens=2048, num_kv_blocks=batch * (context // 16 + 8)))
    if layered:
        llm.engine.model.model.use_native_decode(False)
    params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        llm.add_request(f"r{i}", [(7 * i + j) % 1000 + 100 for j in range(context)], params)
    while llm.engine.stats().generation_tokens < batch:  # every prompt prefilled: only decodes from here
        if any(output.error for output in llm.step()):
            raise RuntimeError(f"{impl}: a step failed; see the engine's log")
    return llm


def measure(impl: str, dtype: str, threads: int, batch: int, context: int, steps: int, model: str | None = None
            ) -> dict[str, float]:
    llm = decode_batch(impl, dtype, threads, batch, context, model)
    per_step: list[dict[str, float]] = []
    for _ in trange(steps, desc=f"{impl} decode steps"):
        clock = PhaseClock()
        with instrumented(llm, clock):
            start = time.perf_counter()
            llm.step()
            total = time.perf_counter() - start
        s = clock.seconds
        core = total - s["front end"]
        per_step.append({"step": total, "core step": core, "linear": s["linear"], "attention": s["attention"],
                         "one-call layers": s["one-call layers"],
                         "other model ops": s["model"] - s["linear"] - s["attention"] - s["one-call layers"], "sampler": s["sampler"],
                         "scheduler": s["scheduler"], "rest of core step": core - s["model"] - s["sampler"] - s["scheduler"],
                         "front end: outputs": s["front end"], "of which detokenizer": s["detokenizer"]})
    return {key: statistics.median(step[key] for step in per_step) * 1e3 for key in per_step[0]}


@cli.command()
def main(impls: str = "native,hf", dtype: str = "bfloat16", threads: int = 2, batch: int = 64, context: int = 200,
         steps: int = 30, model: str = typer.Option("", help="a checkpoint directory (default: the embedded model)")):
    results = {impl: measure(impl, dtype, threads, batch, context, steps, model or None) for impl in impls.split(",")}
    table = Table(title=f"{model or 'the embedded model'}: one decode step, batch {batch}, context ~{context}, {dtype}, {threads} threads: "
                        f"median ms of {steps} steps (share of step)")
    table.add_column("phase")
    for impl in results:
        table.add_column(impl, justify="right")
    for phase in ["step"] + PHASES:
        table.add_row(phase, *(f"{r[phase]:.1f} ({r[phase] / r['step']:.0%})" for r in results.values()))
    Console().print(table)


if __name__ == "__main__":
    restart_as_served()
    cli()
