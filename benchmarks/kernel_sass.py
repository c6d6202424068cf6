"""What the attention kernels (and the sampler's top-p) compile to, on any machine: each is built for a GPU target
(sm_90 by default) as triton's JIT would specialize it at Qwen2.5-1.5B's shapes (bf16, 12/2 heads of 128, blocks of
16; a vocabulary of 151,936), and its
machine code (SASS, from the nvdisasm triton ships) is read for registers, spills, how global memory is loaded, and
each loop's instructions per iteration with its tensor-core ops among them. No GPU times anything here: this is
where a kernel's issue cost and register pressure show between GPU runs, and how a change to one is judged before
a GPU measures it.

python benchmarks/kernel_sass.py                        # prefill and decode, sm_90
python benchmarks/kernel_sass.py --target sm_80 --out benchmarks/results/kernel-sass.json
python benchmarks/kernel_sass.py --heads 8 --kv-heads 4 --head-dim 256    # Gemma 2/3's attention
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # compiling needs triton's own language, before triton is imported

cli = typer.Typer(add_completion=False)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, VOCAB = 12, 2, 128, 16, 151_936
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\S*)")
BACK_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
TENSOR_OPS = ("HGMMA", "HMMA")


def launches(prompt: int, batch: int, heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> dict:
    """The engine's launches of the kernels that read the paged pool, at an attention shape (Qwen2.5-1.5B's), and
    of the top-p threshold over `batch` rows of its vocabulary."""
    import torch

    from engine.kernels.triton.decode import decode_launches
    from engine.kernels.triton.nucleus import nucleus_threshold_launch
    from engine.kernels.triton.prefill import prefill_launch

    blocks = -(-prompt // BLOCK_SIZE)
    cache = torch.zeros(kv_heads, blocks + 1, BLOCK_SIZE, head_dim, dtype=torch.bfloat16)
    tables = torch.zeros(batch, blocks, dtype=torch.long)
    query = torch.zeros(prompt, heads, head_dim, dtype=torch.bfloat16)
    one_prompt = (torch.tensor([0, prompt]), torch.tensor([prompt]))
    decode = query[:batch]
    lens = torch.full((batch,), prompt)
    return {"prefill": prefill_launch(query, cache, cache, tables[:1], *one_prompt, prompt, head_dim**-0.5, query),
            "decode": decode_launches(decode, cache, cache, tables, lens, head_dim**-0.5, 1, decode)[0],
            "nucleus": nucleus_threshold_launch(torch.zeros(batch, VOCAB), torch.zeros(batch), torch.zeros(batch))}


def disassemble(cubin: bytes, tool: str) -> str:
    import triton

    binary = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(binary), "-c" if tool == "nvdisasm" else "-res-usage", file.name],
                              capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[dict]:
    """Each loop (a label a later branch jumps back to): its instructions per iteration, tensor-core ops, warp
    shuffles and barriers among them."""
    lines = sass.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", line.strip())}
    found = []
    for end, line in enumerate(lines):
        match = BACK_BRANCH.search(line)
        start = labels.get(match.group(1)) if match else None
        if start is None or start > end:
            continue
        ops = [m.group(1) for m in map(INSTRUCTION.match, lines[start:end + 1]) if m]
        if len(ops) > 1:  # not the trap loop at a kernel's end
            found.append({"instructions": len(ops), "tensor_ops": sum(op in TENSOR_OPS for op in ops),
                          "shuffles": ops.count("SHFL"), "barriers": ops.count("BAR"),
                          "top": dict(Counter(ops).most_common(6))})
    return found


def profile(launch, target: str) -> dict:
    from engine.kernels.triton.launch import GPU_TARGETS

    compiled = launch.compile_for(GPU_TARGETS[target])
    sass = disassemble(compiled.asm["cubin"], "nvdisasm")
    usage = disassemble(compiled.asm["cubin"], "cuobjdump")
    ops = Counter(m.group(1) + m.group(2) for m in map(INSTRUCTION.match, sass.splitlines()) if m)
    loads = {op: n for op, n in ops.items() if op.startswith(("LDG.", "LDGSTS."))}  # by width; LDGSTS: cp.async
    resource = {name: int(re.search(rf"{name.upper()}:(\d+)", usage).group(1)) for name in ("reg", "stack")}
    return {"registers": resource["reg"], "stack": resource["stack"],
            "spill_instructions": sum(n for op, n in ops.items() if op.startswith(("LDL", "STL"))),
            "instructions": sum(ops.values()), "global_loads": loads, "loops": loops(sass),
            "tiling": {k: v for k, v in launch.constexprs.items() if k in ("ROWS", "BLOCK_Q", "TILE")}}


@cli.command()
def main(target: str = typer.Option("sm_90", help="sm_80, sm_89 or sm_90"),
         prompt: int = typer.Option(4096, help="the prefill's tokens, and the decode's context"),
         batch: int = typer.Option(256, help="the decode's sequences"),
         heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
         out: Path | None = typer.Option(None, help="a JSON file for the profiles")):
    kernels = launches(prompt, batch, heads, kv_heads, head_dim)
    profiles = {name: profile(launch, target) for name, launch in kernels.items()}
    table = Table(title=f"kernels compiled for {target} as triton's JIT specializes them: "
                        f"{heads}/{kv_heads} heads of {head_dim}, bf16, blocks of {BLOCK_SIZE}; top-p over {VOCAB:,}")
    for column in ("kernel", "tiling", "registers", "spills", "instructions", "global loads",
                   "loops: instructions (tensor ops)"):
        table.add_column(column)
    for name, p in profiles.items():
        table.add_row(name, str(p["tiling"]), str(p["registers"]), str(p["spill_instructions"]),
                      str(p["instructions"]), ", ".join(f"{op} {n}" for op, n in sorted(p["global_loads"].items())),
                      ", ".join(f"{loop['instructions']} ({loop['tensor_ops']})" for loop in p["loops"]))
    Console(width=200).print(table)
    if out is not None:
        out.write_text(json.dumps({"target": target, "prompt": prompt, "batch": batch, "heads": heads,
                                   "kv_heads": kv_heads, "head_dim": head_dim, "kernels": profiles}, indent=2))


if __name__ == "__main__":
    cli()
