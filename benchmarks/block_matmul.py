"""The engine's GGUF block matmul (engine/csrc/interleaved_matmul_cpu.cpp over 16-row interleaved blocks) of each
source tree and ISA build, timed alternated in one process over SmolLM2-135M's layers of qkv/o/gate_up/down (30,
cold: each its own weights), with oneDNN's dense fp32 matmul of the same weights beside it. Before anything is
timed, every build's outputs are checked equal, bit for bit, to the first's, and to the dense matmul's within the
activations' 16-bit rounding.

python benchmarks/block_matmul.py --other /tmp/base --isas native --rows 1,2,4,8,16,32,64 --kinds q4,q8
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cpu_flags  # noqa: E402  the sibling script
from engine.layers.quantized import BLOCK, BlockWeight  # noqa: E402
from int4_matmul import LAYERS, SHAPES  # noqa: E402
from tree_kernels import alternated_medians, build_tree_kernels  # noqa: E402

cli = typer.Typer(add_completion=False)


def build(tree: Path, isa: str):
    return build_tree_kernels(tree, isa, ["q4_matmul", "q8_matmul"])


def random_blocks(kind: str, out: int, inp: int) -> BlockWeight:
    groups = inp // BLOCK
    scales = (torch.rand(out, groups) * 0.01).half().float()  # GGUF's fp16 scales
    if kind == "q4":
        codes = torch.randint(0, 256, (out, groups * 16), dtype=torch.uint8)
        return BlockWeight("q4", codes, scales, (torch.randn(out, groups) * 0.01).half().float())
    return BlockWeight("q8", torch.randint(-128, 128, (out, groups * 32), dtype=torch.int8).view(torch.uint8), scales, None)


def layer_calls(kind: str, layers: int):
    """(blocks packed, dense weight for oneDNN, in_features, the blocks) for each layer's four linears."""
    for _ in range(layers):
        for out, inp in SHAPES:
            weight = random_blocks(kind, out, inp)
            packed = weight.pack()  # interleaved where this CPU reads them so (the test skips elsewhere)
            dense = torch.ops.mkldnn._reorder_linear_weight(weight.dequantize(), 64)
            yield packed, dense, inp, weight


def block_call(module, packed):
    if packed.kind == "q4":
        return lambda x: module.q4_matmul(x, packed.codes, packed.scales, packed.mins)
    return lambda x: module.q8_matmul(x, packed.codes, packed.scales)


def rounding_bound(weight: BlockWeight, x: torch.Tensor) -> torch.Tensor:
    """How far x W^T may move when the kernel rounds x to int16 codes per 32-element block (a step of the block's
    largest magnitude / 32767, so at most half a step an element), plus fp32's summation order."""
    w = weight.dequantize().abs()
    blocks = x.abs().view(x.shape[0], -1, BLOCK)
    half_step = (blocks.amax(-1, keepdim=True) / 32767 / 2).expand_as(blocks).reshape(x.shape)
    return half_step @ w.T + 1e-5 * (x.abs() @ w.T) + 1e-6


def check_outputs(variants: dict, builds: list[str], x_by_in: dict, weights: list[BlockWeight]) -> None:
    """Every build gives the first's numbers bit for bit, and the dense matmul's within what rounding the activations
    to 16 bits allows (one layer's four linears). A fixed tolerance (1e-3) failed ~1 linear in 100 on random data:
    the error grows with the rows' blocks, not with the output."""
    firsts = variants[builds[0]][:4]
    references = [(exact(x_by_in[inp]), rounding_bound(weight, x_by_in[inp]))
                  for (exact, inp), weight in zip(variants["dense fp32 (oneDNN)"][:4], weights)]
    for key in builds:
        for (call, inp), (first, _), (exact, bound) in zip(variants[key][:4], firsts, references):
            x = x_by_in[inp]
            y = call(x)
            assert torch.equal(y, first(x)), f"{key} differs from {builds[0]}"
            excess = ((y - exact).abs() - bound).max().item()
            assert excess <= 0, f"{key} is not the matmul: {excess:.3g} past the rounding's bound"


def sweep_ms(calls, x_by_in) -> float:
    start = time.perf_counter()
    for call, inp in calls:
        call(x_by_in[inp])
    return (time.perf_counter() - start) * 1e3


@cli.command()
def main(isas: str = "native", other: str = "", threads: int = 2, rows: str = "1,2,4,8,16,32,64", kinds: str = "q4,q8",
         rounds: int = 9, layers: int = LAYERS, out: str = ""):
    trees = [("this tree", ROOT)] + ([(other, Path(other))] if other else [])
    modules = {f"{name} {isa}": build(tree, isa) for name, tree in tqdm(trees, desc="builds") for isa in isas.split(",")}
    torch.set_num_threads(threads)
    results = []
    with torch.inference_mode():
        for kind in kinds.split(","):
            linears = list(tqdm(layer_calls(kind, layers), total=layers * len(SHAPES), desc=f"{kind} weights"))
            variants = {key: [(block_call(m, p), inp) for p, _, inp, _ in linears] for key, m in modules.items()}
            variants["dense fp32 (oneDNN)"] = [
                (lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), inp) for _, w, inp, _ in linears]
            for m in tqdm(list(map(int, rows.split(","))), desc=f"{kind} rows"):
                x_by_in = {i: torch.randn(m, i) for i in {inp for _, _, inp, _ in linears}}
                check_outputs(variants, list(modules), x_by_in, [w for *_, w in linears[:4]])
                timers = {key: lambda calls=calls: sweep_ms(calls, x_by_in) for key, calls in variants.items()}
                medians = alternated_medians(timers, rounds, warm=2)
                results += [dict(kind=kind, rows=m, variant=key, ms=ms) for key, ms in medians.items()]
    names = list(dict.fromkeys(r["variant"] for r in results))
    table = Table(title=f"{layers} layers of qkv/o/gate_up/down, ms a sweep, {threads} thread(s), median of {rounds} alternated rounds")
    for column in ("kind", "rows", *names):
        table.add_column(column, justify="right")
    for kind in kinds.split(","):
        for m in map(int, rows.split(",")):
            ms = {r["variant"]: r["ms"] for r in results if r["kind"] == kind and r["rows"] == m}
            table.add_row(kind, str(m), *(f"{ms[n]:.2f}" for n in names))
    Console().print(table)
    if out:
        Path(out).write_text(json.dumps(dict(cpu_flags=cpu_flags(), threads=threads, rows=results), indent=1))


if __name__ == "__main__":
    cli()
