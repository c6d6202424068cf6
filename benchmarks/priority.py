"""What the priority policy buys the requests that ask for it, and what it costs: a saturated engine (more requests
than max_num_seqs) with half the requests at priority 0 and half at 1, interleaved, under fcfs (every request at 0,
the classes only labels) and under `scheduling_policy: priority`. Per class: the median and p90 wait before the first
step, and the median time to the last token; with the run's output tokens per second.

    python benchmarks/priority.py [--requests 32] [--max-num-seqs 4] [--max-tokens 32] [--repeats 3] [--dtype float32]
"""
from __future__ import annotations

import statistics

import typer
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from engine import LLM, SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_run(llm: LLM, prompts: list[str], params: SamplingParams, classes: list[int], by_priority: bool) -> dict:
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=classes if by_priority else None)
    start = min(o.metrics.arrival_time for o in outputs)
    end = max(o.metrics.finish_time for o in outputs)
    result = {"tok/s": sum(o.num_tokens for o in outputs) / (end - start)}
    for rank in sorted(set(classes)):
        mine = [o for o, c in zip(outputs, classes) if c == rank]
        waits = [o.metrics.first_scheduled_time - o.metrics.arrival_time for o in mine]
        result[rank] = (statistics.median(waits), percentile(waits, 0.9),
                        statistics.median(o.metrics.finish_time - o.metrics.arrival_time for o in mine))
    return result


def main(requests: int = 32, max_num_seqs: int = 4, max_tokens: int = 32, repeats: int = 3, dtype: str = "float32"):
    prompts = [f"Request {i}: write a short story about the number {i}." for i in range(requests)]
    classes = [i % 2 for i in range(requests)]  # interleaved: every other request is urgent
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    table = Table(title=f"{requests} requests (half at priority 0), max_num_seqs {max_num_seqs}, {max_tokens} tokens "
                        f"each, {dtype}: medians of {repeats} runs")
    for column in ("policy", "class", "wait median s", "wait p90 s", "end-to-end median s", "tok/s"):
        table.add_column(column, justify="right" if column != "policy" else "left")
    for policy in tqdm(("fcfs", "priority"), desc="policies"):
        llm = LLM(dtype=dtype, max_num_seqs=max_num_seqs, num_kv_blocks=512, scheduling_policy=policy)
        one_run(llm, prompts[:max_num_seqs], params, classes[:max_num_seqs], policy == "priority")  # warm-up
        runs = [one_run(llm, prompts, params, classes, policy == "priority") for _ in range(repeats)]
        speed = statistics.median(r["tok/s"] for r in runs)
        for rank in (0, 1):
            wait, wait_p90, total = (statistics.median(r[rank][k] for r in runs) for k in range(3))
            table.add_row(policy, str(rank), f"{wait:.2f}", f"{wait_p90:.2f}", f"{total:.2f}",
                          f"{speed:.0f}" if rank == 0 else "")
        llm.shutdown()
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
