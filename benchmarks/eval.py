"""make eval: the output quality of engine configurations against a reference configuration, on text shipped with
the project (benchmarks/eval_texts.py).

- perplexity of the paragraphs, teacher-forced through the engine's own forward over the paged cache (prompt
  logprobs), next to transformers' fp32 forward on the same weights;
- greedy agreement: the share of instructions whose first N greedy tokens equal the reference configuration's, and
  the mean length of the matching prefix;
- judge: the mean log-likelihood per token that the reference model gives each configuration's answers.

Each configuration is held to a bar (BARS); a fast subset of the same checks runs in `make test`
(tests/benchmarks/test_eval_bars.py).

python benchmarks/eval.py --configs fp32,bf16,gguf,gguf-blocks,nf4,int8,fp8-e4m3,fp8-e5m2,hf,spec --tokens 32
"""
from __future__ import annotations

import gc
import json
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models import resolve_model_path  # noqa: E402
from eval_texts import INSTRUCTIONS, PARAGRAPHS  # noqa: E402  the sibling module

app = typer.Typer(add_completion=False)
console = Console()
CONFIGS = {  # engine settings per name; fp32 dense native is the reference
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "gguf": {"dtype": "float32", "quantization": "gguf"},  # batches of 40: the dense copy of the blocks
    "gguf-blocks": {"dtype": "float32", "quantization": "gguf", "max_num_seqs": 2},  # decodes of 1-2 rows: the blocks
    "nf4": {"dtype": "float32", "quantization": "nf4"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "hf": {"dtype": "float32", "model_impl": "hf"},
    "fp8-e4m3": {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"},  # one byte a K/V value
    "fp8-e5m2": {"dtype": "float32", "kv_cache_dtype": "fp8_e5m2"},
    "spec": {"dtype": "float32", "speculative": {"num_speculative_tokens": 4, "disable_by_batch_size": 64, "weigh_cost": False}},
}
# The bar each configuration must pass: (perplexity at most this multiple of transformers' fp32 forward on the same
# weights, greedy answers identical to the reference at least this share). Speculation must change no token.
BARS = {"fp32": (1.001, 1.0), "hf": (1.001, 0.9), "gguf": (1.001, 0.9), "gguf-blocks": (1.001, 0.9),
        "spec": (1.001, 1.0), "bf16": (1.02, 0.25), "int8": (1.03, 0.0), "nf4": (1.35, 0.0),
        "fp8-e4m3": (1.02, 0.0), "fp8-e5m2": (1.03, 0.0)}


def failed_bars(name: str, row: dict, hf_perplexity_value: float) -> list[str]:
    """What keeps configuration `name` (its eval row) below its bar; empty when it passes."""
    max_ratio, min_identical = BARS[name]
    problems = []
    if row["perplexity"] > max_ratio * hf_perplexity_value:
        problems.append(f"perplexity {row['perplexity']:.3f} > {max_ratio} x transformers' {hf_perplexity_value:.3f}")
    if row.get("identical", 1.0) < min_identical:
        problems.append(f"{row['identical']:.0%} of greedy answers identical < {min_identical:.0%}")
    return problems


def engine_for(name: str, model: str) -> LLM:
    return LLM(model=model, **({"num_kv_blocks": 1024, "max_num_seqs": 64} | CONFIGS[name]))


def perplexity(llm: LLM, texts: list[str]) -> float:
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    scores = [o.prompt_logprobs[p][o.prompt_token_ids[p]] for o in outs for p in range(1, len(o.prompt_token_ids))]
    return math.exp(-statistics.fmean(scores))


@torch.inference_mode()
def hf_perplexity(model: str, llm: LLM, texts: list[str]) -> float:
    """transformers' own fp32 forward on the same checkpoint and the same token ids."""
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=torch.float32).eval()
    scores = []
    for text in texts:
        ids = llm.inputs.tokenize(text)
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
        scores += logprobs.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    return math.exp(-statistics.fmean(scores))


def greedy_answers(llm: LLM, instructions: list[str], tokens: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": text}] for text in instructions]
    outs = llm.chat(chats, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def agreement(reference: list[list[int]], answers: list[list[int]]) -> tuple[float, float]:
    """(share of identical answers, mean length of the prefix each shares with the reference)"""
    prefixes = [next((i for i, (a, b) in enumerate(zip(ref, ans)) if a != b), min(len(ref), len(ans)))
                for ref, ans in zip(reference, answers)]
    identical = sum(ref == ans for ref, ans in zip(reference, answers))
    return identical / len(reference), statistics.fmean(prefixes)


def judge(reference: LLM, instructions: list[str], answers: list[list[int]]) -> float:
    """Mean logprob per answer token under the reference model, teacher-forced after the instruction."""
    prompts = [reference.inputs.tokenize([{"role": "user", "content": text}]) for text in instructions]
    outs = reference.generate([p + a for p, a in zip(prompts, answers)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
    scores = [o.prompt_logprobs[pos][o.prompt_token_ids[pos]]
              for o, prompt in zip(outs, prompts) for pos in range(len(prompt), len(o.prompt_token_ids))]
    return statistics.fmean(scores)


@app.command()
def main(configs: str = "fp32,bf16,gguf,gguf-blocks,nf4,int8,fp8-e4m3,fp8-e5m2,hf,spec", reference: str = "fp32",
         tokens: int = 32, model: str = "SmolLM2-135M-Instruct", out_dir: Path = Path("benchmarks/results"),
         plot: Path = Path("docs/eval.png")):
    names = [reference] + [n for n in configs.split(",") if n != reference]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise typer.BadParameter(f"unknown configurations {unknown}; known: {sorted(CONFIGS)}")
    ref_llm = engine_for(reference, model)
    rows = {"transformers fp32": {"perplexity": hf_perplexity(model, ref_llm, PARAGRAPHS)}}
    ref_answers = greedy_answers(ref_llm, INSTRUCTIONS, tokens)
    for name in tqdm(names, desc="configurations"):
        llm = ref_llm if name == reference else engine_for(name, model)
        answers = ref_answers if name == reference else greedy_answers(llm, INSTRUCTIONS, tokens)
        identical, prefix = agreement(ref_answers, answers)
        rows[name] = {"perplexity": perplexity(llm, PARAGRAPHS), "identical": identical, "matching_prefix": prefix,
                      "judge": judge(ref_llm, INSTRUCTIONS, answers)}
        if llm is not ref_llm:
            del llm
            gc.collect()
    for name in names:
        rows[name]["failed_bars"] = failed_bars(name, rows[name], rows["transformers fp32"]["perplexity"])
    report(rows, dict(reference=reference, tokens=tokens, model=model, paragraphs=len(PARAGRAPHS),
                      instructions=len(INSTRUCTIONS), bars=BARS), out_dir, plot)


def report(rows: dict[str, dict], settings: dict, out_dir: Path, plot: Path) -> None:
    table = Table(title=f"quality against {settings['reference']}: {settings['paragraphs']} paragraphs, "
                        f"{settings['instructions']} instructions x {settings['tokens']} greedy tokens")
    for column in ("configuration", "perplexity", "identical answers", "mean matching prefix", "judge logprob/token",
                   "bar"):
        table.add_column(column, justify="right")
    for name, r in rows.items():
        table.add_row(name, f"{r['perplexity']:.3f}", f"{r['identical']:.0%}" if "identical" in r else "-",
                      f"{r['matching_prefix']:.1f}" if "matching_prefix" in r else "-",
                      f"{r['judge']:.3f}" if "judge" in r else "-",
                      "-" if "failed_bars" not in r else "; ".join(r["failed_bars"]) or "pass")
    console.print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"eval-{stamp}.json"
    path.write_text(json.dumps({"settings": settings, "results": rows}, indent=2))
    names = [n for n in rows if "judge" in rows[n]]  # the engine configurations, not the transformers row
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, key, title in zip(axes, ("perplexity", "identical", "judge"),
                                ("perplexity (lower is better)", "greedy answers identical to the reference",
                                 "reference logprob per answer token")):
        axis.bar(names, [rows[n][key] for n in names], color="#4C72B0")
        axis.set_title(title, fontsize=10)
        axis.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    plot.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(plot, dpi=110)
    console.print(f"wrote {path} and {plot}")


if __name__ == "__main__":
    app()
