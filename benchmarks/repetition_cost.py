"""What repetition detection costs a token, ours (engine/repetition.py) against vLLM's `check_sequence_repetition`,
in one process of vLLM's virtualenv (the same interpreter), alternated round by round, on the same streams: natural
text (the eval paragraphs through the embedded tokenizer), that text turning into a 9-token loop halfway (what the
rule is for), and a hostile stream, a square-free sequence over three tokens (no pattern ever comes twice in a row,
so neither side stops early, yet a third of any window matches the newest token). Both sides must flag the same
positions, which the peer checks before it times anything.

python benchmarks/repetition_cost.py --vllm-python .venv-peers/bin/python --out benchmarks/results/repetition-cost.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cpu_flags  # noqa: E402  the sibling script
from vllm_script import run_vllm_script  # noqa: E402  the sibling script

cli = typer.Typer(add_completion=False)


def square_free(length: int) -> list[int]:
    """Thue's ternary square-free word: the number of 1s between consecutive 0s of the Thue-Morse sequence."""
    word, ones = [], 0
    for n in range(1, 4 * length):
        if bin(n).count("1") % 2:
            ones += 1
        else:
            word.append(ones)
            ones = 0
            if len(word) == length:
                return word
    raise AssertionError("unreachable: 4n Thue-Morse terms hold n zeros")


def text_tokens(length: int) -> list[int]:
    from transformers import AutoTokenizer

    from engine.models import embedded_checkpoint
    from eval_texts import PARAGRAPHS

    ids = AutoTokenizer.from_pretrained(embedded_checkpoint()).encode(" ".join(PARAGRAPHS))
    return (ids * (length // len(ids) + 1))[:length]


@cli.command()
def main(vllm_python: Path = Path(".venv-peers/bin/python"), length: int = 4096, sizes: str = "8,64,1024",
         min_count: int = 2, rounds: int = 7, out: Path | None = None):
    """Writes rows of microseconds a token by stream and max_pattern_size, both sides, and their ratio."""
    text = text_tokens(length)
    streams = {"text": text, "looping": text[: length // 2] + text[:9] * (length // 18 + 1),
               "square-free": [1000 + t for t in square_free(length)]}
    streams["looping"] = streams["looping"][:length]
    rules = [(int(size), 1, min_count) for size in sizes.split(",")]
    rows = run_vllm_script(vllm_python, "vllm_repetition_peer.py", "-", dict(streams=streams, rules=rules,
                                                                            rounds=rounds), [], threads=1)
    table = Table(title=f"repetition detection, us a token over {length}-token outputs, min_count {min_count}, "
                        f"median of {rounds} alternated rounds")
    for column in ("stream", "max_pattern_size", "ours", "vLLM", "vLLM / ours", "flagged"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["stream"], str(r["max_pattern_size"]), f"{r['ours_us']:.2f}", f"{r['vllm_us']:.2f}",
                      f"{r['vllm_us'] / r['ours_us']:.1f}", str(r["flagged"]))
    Console().print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_flags(), "length": length, "min_count": min_count, "rows": rows},
                                  indent=1))


if __name__ == "__main__":
    cli()
