"""Low-load latency (make bench-latency): decode speed per stream and inter-token latency p50/p95 at 1, 2, 4 and 8
concurrent requests, for dense weights and the embedded GGUF's blocks, offline (the engine's step loop) and, with
--url, through a running server's streaming HTTP API. Each figure is also put against the bytes limit: the weights a
decode step reads, over the machine's read bandwidth measured here by a large in-memory reduction.

python benchmarks/latency.py --variants dense-float32,gguf-float32,gguf-bfloat16 --concurrency 1,2,4,8
(a variant is weights-dtype[-layered], see `engine_for`)
"""
from __future__ import annotations

import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from bench import cpu_flags  # the sibling script
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.layers.linear import Linear
from core_env import restart_as_served  # the sibling script

cli = typer.Typer(add_completion=False)
console = Console(width=150)
PROMPT = "Write a long story about a lighthouse keeper and a storm."


def read_bandwidth_gbs(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a sum over a buffer far larger than the caches: what streaming weights can reach."""
    torch.set_num_threads(threads)
    buffer = torch.ones(int(gib * 2**30) // 4)
    buffer.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / min(times) / 1e9


def step_weight_bytes(llm: LLM, rows: int) -> int:
    """Weight bytes one decode step of `rows` sequences reads: blocks where they run at that size, else the dense copy."""
    total = 0
    for module in llm.engine.model.modules():
        if isinstance(module, Linear):
            dense = module.resident_bytes - (module.blocks.nbytes if module.blocks is not None else 0)
            total += module.blocks.nbytes if rows <= module.block_rows else dense
    return total


def engine_for(variant: str, threads: int) -> LLM:
    """variant: weights-dtype, e.g. gguf-float32; a `-layered` suffix runs small decode steps layer by layer in
    Python instead of as one native call (the comparison for `engine/csrc/decoder_cpu.cpp`)."""
    weights, dtype, *layered = variant.split("-")
    llm = LLM(config=EngineConfig(dtype=dtype, num_threads=threads, quantization=None if weights == "dense" else "gguf",
                                  num_kv_blocks=512, max_num_seqs=16))
    if layered:
        llm.engine.model.model.use_native_decode(False)
    return llm


def offline_itl(llm: LLM, concurrency: int, tokens: int) -> list[float]:
    """Inter-token gaps (s) of `concurrency` requests decoding together; prompts prefilled first, outside the gaps."""
    ids = llm.inputs.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        llm.add_request(f"c{concurrency}-{i}-{time.monotonic_ns()}", ids, params)
    last: dict[str, float] = {}
    gaps: list[float] = []
    while llm.has_unfinished_requests():
        for output in llm.step():
            now = time.perf_counter()
            if output.request_id in last:
                gaps.append(now - last[output.request_id])
            last[output.request_id] = now
    return gaps


def http_itl(url: str, api_key: str | None, concurrency: int, tokens: int) -> list[float]:
    """The same through a server's /v1/chat/completions stream, one thread per request."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=api_key or "none")

    def one(_) -> list[float]:
        """Per-token gaps: a chunk of k tokens (a server's stream interval) stands for k gaps of a k-th of its own,
        each chunk's tokens counted by its logprobs."""
        stream = client.chat.completions.create(model=client.models.list().data[0].id, stream=True, max_tokens=tokens,
                                                temperature=0, messages=[{"role": "user", "content": PROMPT}],
                                                logprobs=True, extra_body={"ignore_eos": True})
        chunks = [(time.perf_counter(), len(chunk.choices[0].logprobs.content)) for chunk in stream
                  if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content]
        return [(b - a) / k for (a, _), (b, k) in zip(chunks, chunks[1:]) for _ in range(k)]

    with ThreadPoolExecutor(concurrency) as pool:
        return [gap for gaps in pool.map(one, range(concurrency)) for gap in gaps]


def llama_cpp_itl(python: str, threads: int, tokens: int, runs: int) -> tuple[list[float], str]:
    """llama.cpp's inter-token gaps on the same GGUF file, one stream (`llama_cpp_peer.py` under its own Python)."""
    import subprocess
    import sys

    from engine.models import embedded_gguf_path

    script = Path(__file__).with_name("llama_cpp_peer.py")
    done = subprocess.run([python, str(script), str(embedded_gguf_path()), "--threads", str(threads), "--tokens",
                           str(tokens), "--runs", str(runs), "--prompt", PROMPT], capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"llama.cpp peer failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    return result["gaps"], result["version"]


def gguf_matmul_bytes() -> int:
    """Bytes of the embedded GGUF's quantized matrices: what llama.cpp reads a decode step (the tied Q8_0 embedding
    once, as its LM head)."""
    from gguf import GGUFReader

    from engine.models import embedded_gguf_path

    return sum(int(t.n_bytes) for t in GGUFReader(str(embedded_gguf_path())).tensors if t.tensor_type.name != "F32")


def against_bytes_limit(row: dict, step_bytes: int, bandwidth_gbs: float) -> dict:
    """The row with the weight MB a step reads and the share of the bytes limit its median step reaches."""
    seconds_at_bandwidth = step_bytes / (bandwidth_gbs * 1e9)
    return {**row, "step_weight_mb": step_bytes / 1e6, "bytes_limit_share": seconds_at_bandwidth / (row["itl_p50_ms"] / 1e3)}


def summarize(gaps: list[float]) -> dict:
    ordered = sorted(gaps)
    p50, p95 = statistics.median(ordered), ordered[int(0.95 * (len(ordered) - 1))]
    return {"itl_p50_ms": p50 * 1e3, "itl_p95_ms": p95 * 1e3, "tok_s_per_stream": 1 / p50}


@cli.command()
def main(variants: str = "dense-float32,gguf-float32,gguf-bfloat16", concurrency: str = "1,2,4,8", tokens: int = 64,
         threads: int = 2, runs: int = 3, url: str | None = None, api_key: str | None = None,
         llama_cpp_python: str | None = None, out_dir: Path = Path("benchmarks/results")):
    """--llama-cpp-python: a Python with llama-cpp-python (make bench-latency-peers), to add llama.cpp's single
    stream on the same GGUF file in the same run."""
    bandwidth = read_bandwidth_gbs(threads)
    levels = [int(c) for c in concurrency.split(",")]
    rows: list[dict] = []
    for variant in tqdm([v for v in variants.split(",") if v], desc="variants"):  # "": the server alone
        llm = engine_for(variant, threads)
        offline_itl(llm, 1, 8)  # warm-up
        for level in levels:
            runs_gaps = [offline_itl(llm, level, tokens) for _ in range(runs)]
            rows.append(against_bytes_limit({"variant": variant, "path": "offline", "concurrency": level,
                                             **summarize([g for gaps in runs_gaps for g in gaps])},
                                            step_weight_bytes(llm, level), bandwidth))
        del llm
    if llama_cpp_python:
        gaps, version = llama_cpp_itl(llama_cpp_python, threads, tokens, runs)
        rows.append(against_bytes_limit({"variant": f"llama.cpp {version}", "path": "offline", "concurrency": 1,
                                         **summarize(gaps)}, gguf_matmul_bytes(), bandwidth))
    if url:
        for level in levels:
            rows.append({"variant": "server", "path": "http", "concurrency": level, **summarize(http_itl(url, api_key, level, tokens))})
    report(rows, bandwidth, threads, out_dir)


def report(rows: list[dict], bandwidth: float, threads: int, out_dir: Path) -> None:
    table = Table(title=f"decode latency, {threads} threads, read bandwidth {bandwidth:.1f} GB/s ({cpu_flags()})")
    for column in ("variant", "path", "concurrent", "tok/s per stream", "ITL p50 ms", "ITL p95 ms", "weights MB/step", "of bytes limit"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["variant"], r["path"], str(r["concurrency"]), f"{r['tok_s_per_stream']:.1f}", f"{r['itl_p50_ms']:.1f}",
                      f"{r['itl_p95_ms']:.1f}", f"{r['step_weight_mb']:.0f}" if "step_weight_mb" in r else "-",
                      f"{r['bytes_limit_share']:.0%}" if "bytes_limit_share" in r else "-")
    console.print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (out_dir / f"latency-{stamp}.json").write_text(json.dumps(
        {"cpu_flags": cpu_flags(), "threads": threads, "read_bandwidth_gbs": bandwidth, "rows": rows}, indent=2))
    plot(rows, out_dir / f"latency-{stamp}.png", threads)
    console.print(f"wrote {out_dir}/latency-{stamp}.json and .png")


def plot(rows: list[dict], path: Path, threads: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant in dict.fromkeys(f"{r['variant']} ({r['path']})" for r in rows):
        points = [r for r in rows if f"{r['variant']} ({r['path']})" == variant]
        ax.plot([r["concurrency"] for r in points], [r["tok_s_per_stream"] for r in points], marker="o", label=variant)
    ax.set(xlabel="concurrent requests", ylabel="decode tok/s per stream", xscale="log", title=f"Decode speed per stream, {threads} threads")
    levels = sorted({r["concurrency"] for r in rows})
    ax.set_xticks(levels, labels=[str(level) for level in levels])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    restart_as_served()
    cli()
