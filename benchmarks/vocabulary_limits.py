"""What one row with allowed_token_ids or bad_words costs a step: the step sampler on a batch of greedy rows, with
none limited, one row allowed a few ids, one row allowed the whole vocabulary (the largest list a request can
send, made a tensor once per request), and one row with 128 bad words, one of them banning a token this step.

    python benchmarks/vocabulary_limits.py [--rows 64] [--vocab 49152] [--dtype bfloat16] [--repeats 30]
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
import typer
from rich.console import Console
from rich.table import Table

from engine.model_runner import StepLogits
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step_sampler import StepSampler


def sequence(params: SamplingParams) -> Sequence:
    seq = Sequence("r", [1, 2, 3], params)
    seq.token_ids += [5, 6, 7]
    allowed = None if params.allowed_token_ids is None else torch.tensor(sorted(set(params.allowed_token_ids)))
    seq.runtime = SimpleNamespace(generator=None, grammar=None, allowed_token_ids=allowed)
    return seq


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def main(rows: int = 64, vocab: int = 49152, dtype: str = "bfloat16", repeats: int = 30):
    logits = torch.randn(rows, vocab, dtype=getattr(torch, dtype))
    plain = SamplingParams(temperature=0.0, max_tokens=64)
    # 128 words: one whose first tokens end the output (so it bans a token this step), the others checked in vain
    words = ((6, 7, 11),) + tuple((9, 10 + i, 11 + i) for i in range(127))
    limited = {
        "no row limited": None,
        "one row, 10 allowed ids": SamplingParams(temperature=0.0, max_tokens=64, allowed_token_ids=list(range(10))),
        f"one row, all {vocab} ids allowed": SamplingParams(temperature=0.0, max_tokens=64,
                                                           allowed_token_ids=list(range(vocab))),
        "one row, 128 bad words, one banning": SamplingParams(temperature=0.0, max_tokens=64, bad_words=["x"],
                                                 bad_words_token_ids=words),
        # the worst a request can send: its whole token budget in words whose every token but the last matches
        "every row, 1,024 bad-word tokens all matching": SamplingParams(
            temperature=0.0, max_tokens=64, bad_words=["x"], bad_words_token_ids=((5, 6, 7, 99),) * 256),
    }
    sampler = StepSampler({0})
    table = Table(title=f"step sampler, {rows} greedy rows, vocab {vocab}, {dtype}: median of {repeats}")
    table.add_column("batch")
    table.add_column("ms", justify="right")
    for name, params in limited.items():
        every = name.startswith("every")
        seqs = [sequence(params if every else plain) for _ in range(rows - 1)] + [sequence(params or plain)]
        step = StepLogits(seqs, logits, [1] * rows, [])
        table.add_row(name, f"{median_ms(lambda: sampler(step, {}), repeats):.2f}")
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
