"""N-gram speculative decoding (prompt lookup): propose the tokens that followed the latest earlier occurrence of a
sequence's last few tokens in its own context, verify them in the next step, keep the longest right prefix. Torch-free.

The proposal costs no model: copy-heavy answers (summaries, extractions, code edits) repeat their prompt, and at
low load a step of 1 + k rows costs about what a step of 1 row does, because decode reads every weight either way.
"""
from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Callable

from engine.config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.sequence import Sequence

TOKEN_BYTES = array("i").itemsize
COUNTERS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")  # fields of EngineStats


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int, window: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `token_ids` (from max_n
    tokens down to min_n) within its last `window` tokens; [] where no such suffix occurred before."""
    context = token_ids[-window:]
    data = array("i", context).tobytes()  # bytes.rfind searches in C; a hit must also fall on a token boundary
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        pattern = data[-n * TOKEN_BYTES:]
        end = (len(context) - 1) * TOKEN_BYTES  # an occurrence must end before the last token: something follows it
        while (hit := data.rfind(pattern, 0, end)) >= 0:
            if hit % TOKEN_BYTES == 0:
                start = hit // TOKEN_BYTES + n
                return context[start : start + k]
            end = hit + len(pattern) - 1
    return []


def accepted_length(drafts: list[int], targets: list[int]) -> int:
    """How many drafts the target tokens confirm, in order (targets has one row more than drafts: the bonus)."""
    count = 0
    while count < len(drafts) and drafts[count] == targets[count]:
        count += 1
    return count


def expected_accepted(acceptance: float, length: int) -> float:
    """Drafts expected to be confirmed out of `length`, if each is with probability `acceptance` given the last was."""
    return sum(acceptance**i for i in range(1, length + 1))


class StepCosts:
    """Seconds a decode-only step takes by its number of rows, as this engine measures them (moving averages): what
    verifying drafts really costs on this CPU, these weights and this batch."""

    def __init__(self):
        self.seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        previous = self.seconds.get(rows)
        self.seconds[rows] = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def best_share(self, decodes: int, drafts: list[tuple[int, float]]) -> int:
        """How many of `drafts` (rows, expected accepted tokens), taken in order, make the most tokens a second.
        A row count not measured yet counts as worth trying once, so that it gets measured."""
        base = self.seconds.get(decodes)
        if base is None:
            return 0  # measure the plain step first
        best, best_rate = 0, decodes / base
        rows, tokens = decodes, float(decodes)
        for i, (draft_rows, expected) in enumerate(drafts, start=1):
            rows, tokens = rows + draft_rows, tokens + expected
            cost = self.seconds.get(rows)
            if cost is None:
                return i
            if tokens / cost > best_rate:
                best, best_rate = i, tokens / cost
        return best


class Speculator:
    """Which running sequences draft before a step, and how many tokens; and what their drafts came to. The engine
    verifies; this only proposes and keeps count."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.costs = StepCosts()
        self.counters = dict.fromkeys(COUNTERS, 0)

    def propose(self, running: list[Sequence], room: Callable[[Sequence], int]) -> None:
        """Set `draft_token_ids` of the sequences that draft: none past `disable_by_batch_size`; each at most
        `room(seq)` tokens and its own draft length; with `weigh_cost`, only as many sequences (likeliest to be
        accepted first) as make the most tokens a second by the measured cost of a step's rows."""
        config = self.config
        if not running or len(running) > config.disable_by_batch_size:
            return
        proposals = []
        for seq in running:
            budget = min(room(seq), seq.draft_stats.next_length(config.num_speculative_tokens))
            if budget > 0 and seq.draft_stats.may_propose():
                drafts = propose_ngram(seq.token_ids, budget, config.prompt_lookup_min, config.prompt_lookup_max,
                                       config.lookup_window)
                if drafts:
                    proposals.append((seq, drafts))
        if config.weigh_cost and proposals:
            proposals = self._worth_their_rows(proposals, running)
        for seq, drafts in proposals:
            seq.draft_token_ids = drafts

    def _worth_their_rows(self, proposals: list, running: list[Sequence]) -> list:
        if any(seq.num_uncomputed_tokens != 1 for seq in running):
            return []  # a step with a prefill chunk is not a decode step: what drafts cost there is not measured
        proposals.sort(key=lambda p: -p[0].draft_stats.acceptance)
        worth = self.costs.best_share(len(running), [(len(d), expected_accepted(s.draft_stats.acceptance, len(d)))
                                                     for s, d in proposals])
        return proposals[:worth]

    def verified(self, seq: Sequence, drafts: list[int], accepted: int) -> None:
        self.counters["spec_drafts"] += 1
        self.counters["spec_draft_tokens"] += len(drafts)
        self.counters["spec_accepted_tokens"] += accepted
        seq.draft_stats.record(len(drafts), accepted, self.config)

    def step_ran(self, num_new_tokens: list[int], drafts: list[list[int]], seconds: float) -> None:
        """Time a decode-only step (every sequence one real token, drafts aside) by its rows."""
        if all(n - len(d) == 1 for n, d in zip(num_new_tokens, drafts)):
            self.costs.record(sum(num_new_tokens), seconds)
