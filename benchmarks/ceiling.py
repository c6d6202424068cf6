"""How far from the machine's ceiling: the bf16 matmul rate at the model's shapes, and FLOPs per token.

python benchmarks/ceiling.py [--batch 256]
"""
from __future__ import annotations

import time

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig

from engine.models import resolve_model_path

app = typer.Typer(add_completion=False)


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of every matmul a decoder layer does per token, then the LM head."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim, hidden, inter = cfg.hidden_size // heads, cfg.hidden_size, cfg.intermediate_size
    per_layer = [(hidden, heads * head_dim), (hidden, kv_heads * head_dim), (hidden, kv_heads * head_dim),
                 (heads * head_dim, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]
    return per_layer * cfg.num_hidden_layers + [(hidden, cfg.vocab_size)]


def time_linear(batch: int, k: int, n: int, dtype, repeats: int = 20) -> float:
    x, w = torch.randn(batch, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


@app.command()
def main(model: str = "SmolLM2-135M-Instruct", batch: int = 256, threads: int = 2):
    torch.set_num_threads(threads)
    cfg = AutoConfig.from_pretrained(resolve_model_path(model))
    shapes = linear_shapes(cfg)
    flops_per_token = sum(2 * k * n for k, n in shapes)
    table = Table(title=f"{model}: {flops_per_token / 1e9:.3f} GFLOP per token in matmuls; batch {batch}, {threads} threads")
    for column in ("dtype", "matmul time / step", "rate (TFLOP/s)", "ceiling tok/s (matmuls only)"):
        table.add_column(column, justify="right")
    for dtype in (torch.bfloat16, torch.float32):
        step = sum(time_linear(batch, k, n, dtype) * shapes.count((k, n)) for k, n in dict.fromkeys(shapes))
        table.add_row(str(dtype).split(".")[-1], f"{step * 1e3:.1f} ms", f"{flops_per_token * batch / step / 1e12:.2f}",
                      f"{batch / step:.0f}")
    Console().print(table)


if __name__ == "__main__":
    app()
