"""N-gram speculative decoding (prompt lookup): propose the tokens that followed the latest earlier occurrence of a
sequence's last few tokens in its own context, verify them in the next step, keep the longest right prefix. Torch-free.

The proposal costs no model: copy-heavy answers (summaries, extractions, code edits) repeat their prompt, and at
low load a step of 1 + k rows costs about what a step of 1 row does, because decode reads every weight either way.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

from engine.config import SpeculativeConfig

TOKEN_BYTES = array("i").itemsize


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


@dataclass
class DraftStats:
    """A sequence's draft length and running acceptance rate. The length follows what was accepted (one more than
    the last verification confirmed, up to k), so each draft row tends to be one that pays; speculation pauses while
    the rate is low."""

    acceptance: float = 1.0  # exponential moving average of accepted / proposed per verification
    paused_steps: int = 0
    length: int | None = None  # drafts to propose next; None: k

    def record(self, proposed: int, accepted: int, config: SpeculativeConfig) -> None:
        self.length = accepted + 1
        self.acceptance = 0.7 * self.acceptance + 0.3 * (accepted / proposed)
        if self.acceptance < config.min_acceptance:
            self.paused_steps, self.acceptance = config.pause_steps, config.min_acceptance * 2

    def next_length(self, k: int) -> int:
        return k if self.length is None else min(k, self.length)

    def may_propose(self) -> bool:
        if self.paused_steps:
            self.paused_steps -= 1
            return False
        return True


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
