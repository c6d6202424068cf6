"""vLLM's reasoning parsers (`--reasoning-parser`): a reasoning model's thinking, between `<think>` and `</think>`,
comes back apart from its answer, as `reasoning` (vLLM's field) and `reasoning_content` (DeepSeek's API's, and
vLLM's before it was renamed). Text-level, so it works on deltas as they stream: a marker split across two deltas is
held back until it is whole."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReasoningParserName = Literal["deepseek_r1", "qwen3"]


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    # the chat template opens the section (DeepSeek-R1's ends the prompt with `<think>`): an output that does not
    # start with `start` is reasoning until `end`; otherwise (Qwen3, whose thinking can be turned off) it is the answer
    opened_by_template: bool


@dataclass(frozen=True)
class ThinkingLimit:
    """vLLM's thinking_token_budget: at most `tokens` tokens in each thinking section, bounded by `fmt`'s markers."""

    tokens: int
    fmt: ReasoningFormat


PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>", opened_by_template=True),
    "qwen3": ReasoningFormat("<think>", "</think>", opened_by_template=False),
}


class ReasoningSplitter:
    """One choice's output, fed as it streams: each delta's reasoning text and answer text."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self.state: Literal["undecided", "reasoning", "answer"] = "undecided"
        self.held = ""  # text not yet assigned: the output's start, or what could begin the end marker
        self.reasoned = False  # whether the output had a reasoning section (it may be empty)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of this delta, as far as they can be told apart yet."""
        self.held += text
        reasoning, answer = "", ""
        if self.state == "undecided":
            self._decide(final=False)
        if self.state == "reasoning":
            reasoning, answer = self._reasoning(final=False)
        if self.state == "answer":
            answer, self.held = answer + self.held, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        if self.state == "undecided":
            self._decide(final=True)
        if self.state == "reasoning":
            return self._reasoning(final=True)
        answer, self.held = self.held, ""
        return "", answer

    def _decide(self, final: bool) -> None:
        start, head = self.fmt.start, self.held.lstrip()
        if head.startswith(start):
            self.held, self.state = head[len(start):], "reasoning"
        elif final or not start.startswith(head):
            self.state = "reasoning" if self.fmt.opened_by_template else "answer"
        self.reasoned = self.state == "reasoning"

    def _reasoning(self, final: bool) -> tuple[str, str]:
        end = self.fmt.end
        at = self.held.find(end)
        if at >= 0:
            reasoning, answer = self.held[:at], self.held[at + len(end):]
            self.held, self.state = "", "answer"
            return reasoning, answer
        keep = 0 if final else _partial_suffix(self.held, end)
        reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return reasoning, ""


def split(text: str, fmt: ReasoningFormat) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, answer), each None where there is none (vLLM's null fields)."""
    splitter = ReasoningSplitter(fmt)
    reasoning, answer = splitter.feed(text)
    more_reasoning, more_answer = splitter.finish()
    reasoning, answer = reasoning + more_reasoning, answer + more_answer
    return (reasoning if splitter.reasoned else None), answer or None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def reasoning_token_count(output_ids: list[int], fmt: ReasoningFormat, start_ids: list[int], end_ids: list[int]) -> int:
    """The output's tokens inside its reasoning section, markers left out (vLLM's usage.completion_tokens_details)."""
    begin = len(start_ids) if output_ids[: len(start_ids)] == list(start_ids) else None
    if begin is None and not fmt.opened_by_template:
        return 0
    begin = begin or 0
    for at in range(begin, len(output_ids) - len(end_ids) + 1):
        if output_ids[at : at + len(end_ids)] == list(end_ids):
            return at - begin
    return len(output_ids) - begin
