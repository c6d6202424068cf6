"""What a grammar compile on the core's compile thread costs the steps beside it: one greedy decode stepped for a few
seconds alone, then while a thread compiling new JSON schemas with the step on every core ("shared", the core before
it left one) and on one core fewer ("core left", what `CoreLoop._share_cores` does), alternated by round.

    python benchmarks/compile_beside_steps.py [--rounds 2] [--schemas 24] [--seconds 4] [--dtype float32]
"""
from __future__ import annotations

import itertools
import statistics
import threading
import time

import torch
import typer
from rich.console import Console
from rich.table import Table

from engine.core_messages import EngineRequest
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutput

fresh_ids = itertools.count()


def new_schema() -> dict:
    """A legitimate schema the compiler has not seen (30 arrays of 30-property objects, ~0.1 s to compile)."""
    i = next(fresh_ids)
    row = {"type": "object", "properties": {f"q{i}_{j}": {"type": "string", "pattern": "[a-z]{2,9}"} for j in range(30)}}
    return {"type": "object", "properties": {f"p{i}_{k}": {"type": "array", "items": row} for k in range(30)}}


def step_times(engine: LLMEngine, seconds: float, step_threads: int, schemas: int) -> tuple[list[float], float]:
    """Step times (s) while `schemas` compile beside them (for `seconds` if none), and the compiles' wall time."""
    compiled_in = [0.0]

    def compile_all():
        start = time.monotonic()
        for _ in range(schemas):
            engine.grammars.prepare(StructuredOutput(json_schema=new_schema()))
        compiled_in[0] = time.monotonic() - start

    compiler = threading.Thread(target=compile_all)
    if schemas:
        compiler.start()
    torch.set_num_threads(step_threads)
    times, end = [], time.monotonic() + seconds
    while compiler.is_alive() if schemas else time.monotonic() < end:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times, compiled_in[0]


def main(rounds: int = 2, schemas: int = 24, seconds: float = 4.0, dtype: str = "float32"):
    engine = LLMEngine(dtype=dtype, num_kv_blocks=1024, max_num_seqs=8)
    engine.grammars.warm_up()
    cores = engine.claim_threads()
    engine.add_request(EngineRequest("decode", list(range(10, 40)), SamplingParams(temperature=0.0, ignore_eos=True,
                                     max_tokens=100_000), 100_000, time.monotonic()))
    for _ in range(20):
        engine.step()
    cases = {"alone": (cores, 0), "shared": (cores, schemas), "core left": (max(1, cores - 1), schemas)}
    table = Table(title=f"one decode beside {schemas} new schemas compiling, {dtype}, {cores} cores")
    for column in ("case", "round", "steps", "median ms", "p90 ms", "max ms", "compiles took s"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for round_ in range(rounds):
        for case, (threads, count) in cases.items():
            times, compiled_in = step_times(engine, seconds, threads, count)
            times.sort()
            table.add_row(case, str(round_ + 1), str(len(times)), f"{statistics.median(times) * 1e3:.1f}",
                          f"{times[int(0.9 * len(times))] * 1e3:.1f}", f"{times[-1] * 1e3:.1f}",
                          f"{compiled_in:.2f}" if count else "-")
    engine.abort("decode")
    engine.step()
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
