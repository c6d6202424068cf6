"""Where torch's packed int4 matmul (`aten._weight_int4pack_mm_for_cpu`, group 32) beats oneDNN's pre-packed dense
weights on this CPU: 30 layers' cold Q4_1-style weights of SmolLM2-135M's merged shapes (qkv, o, gate_up, down), at
several row counts, with fp32 and bf16 activations, and the engine's own block kernel (`engine/layers/quantized.py`).

python benchmarks/int4_matmul.py --threads 2 --rows 1,2,4,8,16,32,64,128
"""
from __future__ import annotations

import statistics
import time

import torch
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

cli = typer.Typer(add_completion=False)
HIDDEN, INTERMEDIATE, KV, GROUP = 576, 1536, 192, 32
SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # (out, in)
LAYERS = 30


def q4_weights():
    """Per layer and shape: (int4 codes [N, K] int32, scales [N, K/32], mins [N, K/32]) as Q4_1 stores them."""
    for _ in range(LAYERS):
        for out, inp in SHAPES:
            yield (torch.randint(0, 16, (out, inp), dtype=torch.int32), (torch.rand(out, inp // GROUP) * 0.01).half().float(),
                   (torch.randn(out, inp // GROUP) * 0.01).half().float())  # GGUF's fp16 scales


def dense(codes, scales, mins, dtype):
    n, k = codes.shape
    w = codes.float().view(n, k // GROUP, GROUP) * scales[..., None] + mins[..., None]
    packed = torch.ops.mkldnn._reorder_linear_weight(w.view(n, k).to(dtype), 64)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def int4(codes, scales, mins, dtype):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    scales_zeros = torch.stack([scales, mins + 8 * scales], -1).transpose(0, 1).contiguous().to(dtype)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)


def blocks(codes, scales, mins, dtype):
    """The engine's own Q4 block kernel (exact weights, fp32 accumulation), as `quantization: gguf` runs it."""
    from engine.layers.quantized import BlockWeight, block_matmul

    n, k = codes.shape
    pairs = codes.to(torch.uint8).view(n, k // GROUP, 2, 16)
    weight = BlockWeight("q4", (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2).contiguous(), scales, mins)
    packed = weight.pack()
    return lambda x: block_matmul(x, packed, None)


VARIANTS = {"engine blocks fp32": (blocks, torch.float32), "dense fp32": (dense, torch.float32), "dense bf16": (dense, torch.bfloat16),
            "int4 fp32": (int4, torch.float32), "int4 bf16": (int4, torch.bfloat16),
            "int4 fp16": (int4, torch.float16)}


def sweep_ms(layers, x_by_in, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for run, in_features in layers:
            run(x_by_in[in_features])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@cli.command()
def main(threads: int = 2, rows: str = "1,2,4,8,16,32,64,128", repeats: int = 7,
         variants: str = "engine blocks fp32,dense fp32,dense bf16,int4 bf16"):  # int4 fp32/fp16: seconds a sweep
    torch.set_num_threads(threads)
    weights = list(q4_weights())
    names = variants.split(",")
    table = Table(title=f"30 layers of qkv/o/gate_up/down, Q4_1-style weights, {threads} threads: ms per sweep (median of {repeats})")
    for column in ("rows", *names, "best"):
        table.add_column(column, justify="right")
    with torch.inference_mode():
        built = {name: [(VARIANTS[name][0](*w, VARIANTS[name][1]), w[0].shape[1]) for w in weights]
                 for name in tqdm(names, desc="packing")}
        for m in tqdm(list(map(int, rows.split(","))), desc="rows"):
            ms = {}
            for name in names:
                x_by_in = {i: torch.randn(m, i, dtype=VARIANTS[name][1]) for i in (HIDDEN, INTERMEDIATE)}
                ms[name] = sweep_ms(built[name], x_by_in, repeats)
            table.add_row(str(m), *(f"{ms[n]:.1f}" for n in names), min(ms, key=ms.get))
    Console().print(table)


if __name__ == "__main__":
    cli()
