"""A reasoning model's thinking, bounded: vLLM's thinking_token_budget. Once a thinking section (after its start
marker, in the prompt or the output) has `tokens` tokens, the end marker is forced, token by token, and the model
answers; a later section gets a budget of its own. The markers are token ids (the app's reasoning parser's `<think>`
and `</think>`, tokenized). Torch-free: the core advances the countdown with each token, the sampler allows only the
token it forces."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineInputError

MAX_MARKER_TOKENS = 64
PARAM = "thinking_token_budget"


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` tokens of thinking between `start` and `end` (token ids), a section at a time."""

    tokens: int
    start: tuple[int, ...]
    end: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or not 0 <= self.tokens < 1 << 31:
            raise EngineInputError(f"{PARAM} must be a non-negative integer (no budget: None), got {self.tokens!r}",
                                   PARAM)
        for name in ("start", "end"):
            marker = getattr(self, name)
            if not isinstance(marker, tuple) or not 0 < len(marker) <= MAX_MARKER_TOKENS or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in marker):
                raise EngineInputError(f"{PARAM}: the thinking section's {name} marker must be 1 to "
                                       f"{MAX_MARKER_TOKENS} token ids", PARAM)


class ThinkingCountdown:
    """One request's thinking: whether it is in a section, how many tokens the section holds, and which token of
    the end marker is forced next (or none)."""

    def __init__(self, budget: ThinkingBudget, prompt_token_ids: list[int]):
        self.budget = budget
        # active: in a section, so what the next token may be depends on the tokens before it
        self.active, self.thought, self.forcing = False, 0, -1
        start = _last_index(prompt_token_ids, budget.start)
        if start >= 0 and start > _last_index(prompt_token_ids, budget.end):  # the prompt opened a section
            self._open(len(prompt_token_ids) - start - len(budget.start))

    def forced(self) -> int | None:
        """The token the next one must be: the end marker's next, once the section has spent its budget."""
        return self.budget.end[self.forcing] if self.forcing >= 0 else None

    def free_tokens(self) -> int:
        """How many of the next tokens are the model's whatever they are (none forced): the rest of an open section's
        budget, or where none is open the budget and one (the next token may be a start marker's last). Async
        scheduling launches a row's step ahead with two, and a step verifies drafts for all but one of them."""
        if self.forcing >= 0:
            return 0
        return self.budget.tokens - self.thought if self.active else self.budget.tokens + 1

    def append(self, token_ids: list[int]) -> None:
        """Advance by the last of `token_ids` (the whole sequence, the new token last)."""
        end = self.budget.end
        if self.forcing >= 0:
            self.forcing += 1
            if self.forcing == len(end):
                self.active, self.forcing = False, -1
        elif self.active:
            if _ends_with(token_ids, end):
                self.active = False
            else:
                self._open(self.thought + 1)
        elif _ends_with(token_ids, self.budget.start):
            self._open(0)

    def _open(self, thought: int) -> None:
        self.active, self.thought = True, thought
        if thought >= self.budget.tokens:
            self.forcing = 0


def _ends_with(token_ids: list[int], marker: tuple[int, ...]) -> bool:
    return len(token_ids) >= len(marker) and tuple(token_ids[-len(marker):]) == marker


def _last_index(token_ids: list[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last starts in `token_ids`, or -1."""
    for i in range(len(token_ids) - len(marker), -1, -1):
        if token_ids[i] == marker[0] and tuple(token_ids[i : i + len(marker)]) == marker:
            return i
    return -1
