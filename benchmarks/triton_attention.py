"""The Triton attention kernels alone, against the GPU's peak: decode at batch 1/32/256 and contexts 256/2k/32k, and
a 4k-token prefill, Qwen2.5-1.5B's attention shape (12 query heads, 2 KV heads of 128, bf16). Each sequence's blocks
are scattered over the pool. Decode is judged by the bytes it must read (every K and V of every context, once, and
nothing padded: the kernel reads the pool in place) per second; prefill by its causal FLOPs per second. Then the
greedy sampler and top-p over Qwen's 152k vocabulary at batch 1 and 256, the Triton kernels against the torch ops,
by the bytes of one read of the logits.

Last, a sweep of the kernels' tilings (rows a program takes, context positions a loop step reads, warps, pipeline
stages) on the prefill and on two decode shapes, each checked against the default's output: the data the engine's
defaults are to be chosen from, which no GPU has measured yet.

On CUDA a case is timed as a CUDA graph of several calls, as the engine's decode step runs: device time, not the
Python of a launch (the first H100 run timed single launches, and its small cases, ~100 us, were mostly that).

python benchmarks/triton_attention.py                 # on the GPU
python benchmarks/triton_attention.py --device cpu    # toy shapes under triton's interpreter: the script itself runs
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.roofline import gpu_spec  # noqa: E402

cli = typer.Typer(add_completion=False)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 2, 128, 16  # Qwen2.5-1.5B's attention, the engine's block size


def scattered_pool(batch: int, context: int, kv_heads: int, head_dim: int, block_size: int, dtype, device):
    import torch

    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 1
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator).to(device, dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=generator)[: batch * per_seq].view(batch, per_seq).to(device)
    return k, v, tables


GRAPHED_CALLS = 10  # calls a CUDA graph replays per timing
# each entry a set of keyword arguments for prefill_launch / decode_launches; {} is the engine's default. None
# spills registers on sm_90 (benchmarks/kernel_sass.py): 128 rows on 4 warps and 128-position tiles did, and are out
PREFILL_TILINGS = [{}, dict(num_stages=2), dict(num_warps=8), dict(rows_per_program=128, num_warps=8, num_stages=2),
                   dict(rows_per_program=128, num_warps=8, num_stages=3),
                   dict(rows_per_program=128, num_warps=8, num_stages=4),
                   dict(rows_per_program=128, tile=32, num_warps=8, num_stages=3)]
# splits: the context cut into parts even where (sequence, KV head) pairs outnumber the SMs (the engine splits only
# below that): at batch 256 and ~160 tokens a program reads 3 tiles one after another, latency more than bandwidth
DECODE_TILINGS = [{}, dict(tile=32), dict(tile=128), dict(tile=128, num_warps=8), dict(tile=256, num_warps=8),
                  dict(num_warps=2), dict(tile=32, num_stages=2), dict(splits=2), dict(splits=4, tile=32)]


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of one call, after a warm-up (the first call compiles). `device` "eager": timed by the host
    clock whatever the device, for an op that reads the device back (a CUDA graph cannot hold it)."""
    import torch

    fn()
    if device == "cuda":
        return _graph_timed(fn, repeats)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def _graph_timed(fn, repeats: int) -> float:
    import torch

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPHED_CALLS):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / GRAPHED_CALLS)
    return sorted(times)[len(times) // 2]


def decode_inputs(batch: int, context: int, device):
    """Decode at Qwen's attention shape in bf16: (query, K pool, V pool, block tables, context lengths)."""
    import torch

    k, v, tables = scattered_pool(batch, context, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, device)
    query = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return query, k, v, tables, torch.full((batch,), context, device=device)


def prefill_inputs(tokens: int, device):
    """One prompt of `tokens` at Qwen's attention shape in bf16: (query, K pool, V pool, block tables, query starts,
    context lengths)."""
    import torch

    k, v, tables = scattered_pool(1, tokens, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, device)
    query = torch.randn(tokens, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return query, k, v, tables, torch.tensor([0, tokens], device=device), torch.tensor([tokens], device=device)


def decode_case(batch: int, context: int, device, num_sms: int, repeats: int) -> dict:
    from engine.kernels.triton.decode import decode_attention, num_splits_for

    query, k, v, tables, lens = decode_inputs(batch, context, device)
    splits = num_splits_for(batch, KV_HEADS, context, num_sms)
    seconds = timed(lambda: decode_attention(query, k, v, tables, lens, HEAD_DIM**-0.5, splits), device, repeats)
    read = 2 * batch * context * KV_HEADS * HEAD_DIM * k.element_size()  # K and V of each context, once
    return {"kind": "decode", "batch": batch, "context": context, "splits": splits, "us": round(seconds * 1e6, 1),
            "gb_s": round(read / seconds / 1e9, 1)}


def prefill_case(tokens: int, device, repeats: int) -> dict:
    from engine.kernels.triton.prefill import prefill_attention

    query, k, v, tables, starts, lens = prefill_inputs(tokens, device)
    seconds = timed(lambda: prefill_attention(query, k, v, tables, starts, lens, tokens, HEAD_DIM**-0.5), device, repeats)
    flops = 2 * 2 * HEADS * HEAD_DIM * tokens * (tokens + 1) / 2  # QK^T and PV over the causal half
    return {"kind": "prefill", "batch": 1, "context": tokens, "splits": 1, "us": round(seconds * 1e6, 1),
            "tflop_s": round(flops / seconds / 1e12, 2)}


def greedy_cases(batch: int, vocab: int, device, repeats: int) -> list[dict]:
    """The greedy tokens of a step's bf16 logits: the Triton kernel CUDA's sampler runs, and the torch ops it
    replaced (which the CPU's still runs)."""
    import torch

    from engine.kernels.triton.greedy import greedy_or_invalid
    from engine.sampler import INVALID_TOKEN, _marked_invalid, greedy_and_finite

    logits = torch.randn(batch, vocab, device=device, dtype=torch.bfloat16)
    ways = {"greedy (triton)": lambda: greedy_or_invalid(logits, INVALID_TOKEN),
            "greedy (torch)": lambda: _marked_invalid(*greedy_and_finite(logits))}
    return [_logits_row(kind, fn, logits, device, repeats) for kind, fn in ways.items()]


def top_p_cases(batch: int, vocab: int, device, repeats: int) -> list[dict]:
    """Top-p 0.9 over fp32 probabilities of a temperature-1 row: the Triton search CUDA's sampler runs, and the
    CPU's candidates-then-sort (which reads the device back; timed outside a graph where it cannot be captured)."""
    import torch

    from engine.kernels.triton.nucleus import nucleus
    from engine.sampler import nucleus_threshold_by_candidates

    probs = torch.randn(batch, vocab, device=device).softmax(-1)
    top_p = torch.full((batch, 1), 0.9, device=device)
    return [_logits_row("top-p (triton)", lambda: nucleus(probs, top_p), probs, device, repeats),
            _logits_row("top-p (candidates)", lambda: nucleus_threshold_by_candidates(probs, top_p), probs, "eager",
                        repeats)]


def _logits_row(kind: str, fn, logits, device: str, repeats: int) -> dict:
    """A row for an op over [batch, vocab] logits, judged by the bytes of one read of them."""
    seconds = timed(fn, device, repeats)
    batch, vocab = logits.shape
    return {"kind": kind, "batch": batch, "context": vocab, "splits": 1, "us": round(seconds * 1e6, 1),
            "gb_s": round(logits.numel() * logits.element_size() / seconds / 1e9, 1)}


def tiling_cases(device: str, repeats: int) -> list[dict]:
    """Each tiling of PREFILL_TILINGS and DECODE_TILINGS: its time, and whether its output is the default's (within
    bf16 rounding of a different summation order). A tiling the GPU cannot build is reported, not raised."""
    import torch

    from engine.kernels.triton.decode import decode_launches, num_splits_for
    from engine.kernels.triton.prefill import prefill_launch

    cuda = device == "cuda"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    # (256, 160): about the batch and context of make gpu-check's judged decode step (128-token prompts, ~32 steps)
    prefill_tokens, decode_shapes = (4096, [(256, 160), (256, 2048), (1, 32768)]) if cuda else (80, [(3, 100)])
    tilings = (PREFILL_TILINGS, DECODE_TILINGS) if cuda else (PREFILL_TILINGS[:1] + PREFILL_TILINGS[-1:],
                                                              DECODE_TILINGS[:3] + DECODE_TILINGS[-1:])

    def prefill_runner(tokens):
        query, k, v, tables, starts, lens = prefill_inputs(tokens, device)
        out = torch.empty_like(query)
        return out, lambda tiling: [prefill_launch(query, k, v, tables, starts, lens, tokens, HEAD_DIM**-0.5, out,
                                                   **tiling)]

    def decode_runner(batch, context):
        query, k, v, tables, lens = decode_inputs(batch, context, device)
        out = torch.empty_like(query)
        splits = num_splits_for(batch, KV_HEADS, context, num_sms)

        def launches(tiling: dict):
            options = dict(tiling)
            return decode_launches(query, k, v, tables, lens, HEAD_DIM**-0.5, options.pop("splits", splits), out,
                                   **options)
        return out, launches

    shapes = [("prefill", 1, prefill_tokens, prefill_runner(prefill_tokens), tilings[0])]
    shapes += [("decode", b, c, decode_runner(b, c), tilings[1]) for b, c in decode_shapes]
    rows = []
    for kind, batch, context, (out, launches_for), kind_tilings in shapes:
        reference = None
        for tiling in kind_tilings:
            row = {"kind": f"{kind} tiling", "batch": batch, "context": context, "tiling": _label(tiling)}
            try:
                launches = launches_for(tiling)
                out.fill_(float("nan"))  # a tiling that writes nothing must not pass on the one before's output
                seconds = timed(lambda: [launch.run() for launch in launches], device, repeats)
            except Exception as error:  # out of shared memory, say: a tiling this GPU cannot take
                rows.append({**row, "error": f"{type(error).__name__}: {str(error)[:200]}"})
                continue
            result = out.clone()
            reference = result if reference is None else reference
            rows.append({**row, "us": round(seconds * 1e6, 1),
                         "matches_default": bool(torch.allclose(result.float(), reference.float(), atol=2e-2, rtol=2e-2))})
    return rows


def _label(tiling: dict) -> str:
    names = {"rows_per_program": "rows", "tile": "tile", "num_warps": "warps", "num_stages": "stages", "splits": "splits"}
    return " ".join(f"{names[key]}={value}" for key, value in tiling.items()) or "default"


def default_repeats(device: str) -> int:
    """Timed calls a case: one on CPU, where the interpreter's times mean nothing and ten took 12 of a run's 19 s."""
    return 10 if device == "cuda" else 1


def measure_kernels(device: str, repeats: int) -> tuple[str, list[dict]]:
    """(device name, rows): the decode grid, the prefill and the greedy sampler, each with its share of the device's
    peak if known."""
    import torch

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, num_sms = props.name, props.multi_processor_count
        batches, contexts, prefill, vocab = (1, 32, 256), (256, 2048, 32768), 4096, 151936
    else:
        name, num_sms = "cpu (interpreter)", 4
        batches, contexts, prefill, vocab = (1, 4), (64, 300), 96, 3000
    rows = []
    for batch in batches:
        for context in contexts:
            if batch * context * KV_HEADS * HEAD_DIM * 4 > 8 << 30:  # K+V over 8 GiB: batch 256 at 32k
                continue
            rows.append(decode_case(batch, context, device, num_sms, repeats))
    rows.append(prefill_case(prefill, device, repeats))
    for cases in (greedy_cases, top_p_cases):
        for batch in (batches[0], batches[-1]):
            rows += cases(batch, vocab, device, repeats)
    peak = gpu_spec(name)
    for row in rows:
        if peak is not None:
            row["of_peak"] = round(row["gb_s"] / peak[0] if "gb_s" in row else row["tflop_s"] / peak[1], 3)
    return name, rows


@cli.command()
def main(device: str = typer.Option("cuda", help="cuda, or cpu: toy shapes under triton's interpreter"),
         out: Path | None = typer.Option(None, help="a JSON file for the rows"),
         repeats: int | None = typer.Option(None, min=1, help="timed calls a case [default: 10 on cuda, 1 on cpu]"),
         tilings: bool = typer.Option(True, help="also sweep the kernels' tilings")):
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton defines a kernel
    repeats = default_repeats(device) if repeats is None else repeats
    name, rows = measure_kernels(device, repeats)
    swept = tiling_cases(device, repeats) if tilings else []
    table = Table(title=f"Triton kernels on {name}: attention {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, bf16, blocks of "
                        f"{BLOCK_SIZE}; greedy over bf16 logits (context: the vocabulary)")
    for column in ("kind", "batch", "context", "splits", "us", "GB/s or TFLOP/s", "of peak"):
        table.add_column(column, justify="right")
    for row in rows:
        rate = row.get("gb_s", row.get("tflop_s"))
        table.add_row(row["kind"], str(row["batch"]), str(row["context"]), str(row["splits"]), f"{row['us']:,.1f}",
                      str(rate), f"{row['of_peak']:.0%}" if "of_peak" in row else "-")
    Console().print(table)
    if swept:
        print_tilings(swept)
    if out is not None:
        out.write_text(json.dumps({"device": name, "rows": rows, "tilings": swept}, indent=2))


def print_tilings(rows: list[dict]) -> None:
    table = Table(title="the kernels' tilings, bf16 (default: what the engine launches)")
    for column in ("kind", "batch", "context", "tiling", "us", "matches default"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["kind"], str(row["batch"]), str(row["context"]), str(row["tiling"]),
                      f"{row['us']:,.1f}" if "us" in row else row["error"], str(row.get("matches_default", "-")))
    Console().print(table)


if __name__ == "__main__":
    cli()
