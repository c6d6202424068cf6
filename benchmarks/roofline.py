"""Paper estimate of one GPU replica's req/h with Qwen2.5-1.5B-Instruct in bf16: a decode step reads every weight
once plus the batch's KV cache, so it is bound by HBM bandwidth until the batch's FLOPs take longer (a batch of a few
hundred on an H200); prefill is bound by tensor-core FLOPs.

python benchmarks/roofline.py --mean-prompt 100 --mean-output 90 --batches 32,64,128,256
"""
from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

cli = typer.Typer(add_completion=False)

# Qwen2.5-1.5B-Instruct (config.json): 28 layers, hidden 1536, MLP 8960, 12 heads / 2 KV heads of 128, vocab 151936
LAYERS, HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 28, 1536, 8960, 12, 2, 128, 151936
LAYER_PARAMS = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * MLP
MATMUL_PARAMS = LAYERS * LAYER_PARAMS + VOCAB * HIDDEN  # the tied LM head is read every step
WEIGHT_BYTES = 2 * MATMUL_PARAMS
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
GPUS = {  # a part of the name torch reports: (HBM GB/s, dense bf16 TFLOP/s), datasheet figures
    "L4": (300, 121),
    "A10G": (600, 125),
    "L40S": (864, 362),
    "A100": (2039, 312),
    "H100 PCIe": (2000, 756),
    "H100": (3350, 989),  # the SXM part, which torch names "NVIDIA H100 80GB HBM3"
    "H100 NVL": (3900, 835),
    "H200": (4800, 989),
}
EFFICIENCY = 0.7  # share of peak a tuned kernel reaches; both rooflines are scaled by it
# An eager step of about 25 kernels per layer, 28 layers, ~8 us of launch each: the host cannot issue a step faster
# than this without CUDA graphs. The GPU hides it only where its own step is longer.
LAUNCH_FLOOR_S = 28 * 25 * 8e-6


def gpu_spec(name: str) -> tuple[float, float] | None:
    """(GB/s, TFLOP/s) of the GPU torch names `name`, by the longest key found in it ("L40S" over "L4", "H100 PCIe"
    over "H100"); None for a GPU the table lacks."""
    keys = [key for key in GPUS if key in name]
    return GPUS[max(keys, key=len)] if keys else None


def estimate(bandwidth_gbs: float, tflops: float, batch: int, mean_prompt: float, mean_output: float,
             floor_s: float = 0.0) -> dict:
    context = mean_prompt + mean_output / 2  # average context over a request's decode
    read_s = (WEIGHT_BYTES + batch * context * KV_BYTES_PER_TOKEN) / (bandwidth_gbs * 1e9 * EFFICIENCY)
    # each token multiplies through every weight (2 FLOPs a parameter) and attends over its context (QK and PV)
    flops = batch * (2 * MATMUL_PARAMS + 4 * LAYERS * HEADS * HEAD_DIM * context)
    step_s = max(read_s, flops / (tflops * 1e12 * EFFICIENCY), floor_s)
    decode_rps = batch / (mean_output * step_s)
    prefill_s = mean_prompt * 2 * MATMUL_PARAMS / (tflops * 1e12 * EFFICIENCY)
    rps = 1 / (1 / decode_rps + prefill_s)  # prefill time is taken out of the decode time
    return {"step_ms": step_s * 1e3, "tok_s": batch / step_s, "rph": rps * 3600}


@cli.command()
def main(mean_prompt: float = 100, mean_output: float = 90, batches: str = "32,64,128,256"):
    console = Console()
    table = Table(title=f"Qwen2.5-1.5B bf16, one replica: prompt {mean_prompt:g}, output {mean_output:g} tokens, "
                        f"{EFFICIENCY:.0%} of peak")
    table.add_column("GPU")
    for b in batches.split(","):
        table.add_column(f"batch {b}: step, req/h (with launch floor)", justify="right")
    for name, (bw, tf) in GPUS.items():
        cells = []
        for b in batches.split(","):
            e = estimate(bw, tf, int(b), mean_prompt, mean_output)
            floored = estimate(bw, tf, int(b), mean_prompt, mean_output, LAUNCH_FLOOR_S)
            cells.append(f"{e['step_ms']:.1f} ms, {e['rph'] / 1e3:,.0f}k ({floored['rph'] / 1e3:,.0f}k)")
        table.add_row(f"{name} ({bw} GB/s)", *cells)
    console.print(table)
    console.print(f"weights read per step: {WEIGHT_BYTES / 1e9:.2f} GB; KV per token: {KV_BYTES_PER_TOKEN / 1024:.0f} KiB; "
                  f"launch floor {LAUNCH_FLOOR_S * 1e3:.1f} ms per step")


if __name__ == "__main__":
    cli()
