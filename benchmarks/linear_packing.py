"""Which linear wins on this CPU: plain `F.linear` against oneDNN pre-packed weights (`mkldnn._linear_pointwise`)
and MKL pre-packed fp32 weights (`mkl._mkl_linear`), over 30 layers' cold weights of SmolLM2-135M's merged shapes
(qkv, o, gate_up, down), at several batch sizes. The engine's `engine/layers/linear.py` uses what this shows.
For fp32 it also times two int8 options (issue 14, item 6): fbgemm's dynamic quantization (weights int8 per output
channel, activations quantized per tensor at run time, `quantized.linear_dynamic`) and int8 weight-only
(`aten._weight_int8pack_mm`, activations kept in fp32).

python benchmarks/linear_packing.py --threads 2 --dtypes float32,bfloat16 --rows 1,8,64,256
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

cli = typer.Typer(add_completion=False)
HIDDEN, INTERMEDIATE, KV = 576, 1536, 192
SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # (out, in)
LAYERS = 30


def variants(dtype: torch.dtype, rows: int):
    """name -> (prepare(weight) -> packed, run(x, packed))."""
    found = {"F.linear": (lambda w: w, lambda x, w: F.linear(x, w))}
    found["onednn packed"] = (
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, rows),
        lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    if dtype == torch.float32:
        found["mkl packed"] = (
            lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w),
            lambda x, p: torch.ops.mkl._mkl_linear(x, p[0], p[1], None, rows))
        found["int8 dynamic (fbgemm)"] = (
            lambda w: torch.ops.quantized.linear_prepack(int8_per_channel(w), None),
            lambda x, p: torch.ops.quantized.linear_dynamic(x, p, True))
        found["int8 weight-only"] = (
            lambda w: int8_weight_and_scales(w),
            lambda x, p: torch.ops.aten._weight_int8pack_mm(x, p[0], p[1]))
    return found


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output channel: w ~ q * scale."""
    return w.abs().amax(dim=1).clamp(min=1e-8) / 127


def int8_weight_and_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = int8_scales(w)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def int8_per_channel(w: torch.Tensor) -> torch.Tensor:
    scales = int8_scales(w)
    return torch.quantize_per_channel(w, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)


def sweep_ms(run, weights: list, x_by_in: dict[int, torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w, in_features in weights:
            run(x_by_in[in_features], w)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@cli.command()
def main(threads: int = 2, dtypes: str = "float32,bfloat16", rows: str = "1,8,64,256", repeats: int = 7):
    torch.set_num_threads(threads)
    table = Table(title=f"30 layers of qkv/o/gate_up/down, {threads} threads: ms per sweep (median of {repeats})")
    for column in ("dtype", "rows", "variant", "ms", "TFLOP/s", "x F.linear"):
        table.add_column(column, justify="right")
    flops_per_row = 2 * LAYERS * sum(o * i for o, i in SHAPES)
    with torch.inference_mode():
        for dtype_name in tqdm(dtypes.split(","), desc="dtypes"):
            dtype = getattr(torch, dtype_name)
            raw = [(torch.randn(o, i, dtype=dtype) * 0.02, i) for _ in range(LAYERS) for o, i in SHAPES]
            for m in map(int, rows.split(",")):
                x_by_in = {i: torch.randn(m, i, dtype=dtype) for i in {i for _, i in SHAPES}}
                base = None
                for name, (prepare, run) in variants(dtype, m).items():
                    try:
                        packed = [(prepare(w), i) for w, i in raw]
                        run(x_by_in[raw[0][1]], packed[0][0])
                    except RuntimeError as exc:
                        table.add_row(dtype_name, str(m), name, f"unsupported: {str(exc)[:40]}", "", "")
                        continue
                    ms = sweep_ms(run, packed, x_by_in, repeats)
                    base = base or ms
                    table.add_row(dtype_name, str(m), name, f"{ms:.1f}", f"{flops_per_row * m / ms / 1e9:.2f}", f"{base / ms:.2f}")
    Console().print(table)


if __name__ == "__main__":
    cli()
