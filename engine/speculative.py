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
    """A sequence's running acceptance rate; speculation pauses for it while the rate is low."""

    acceptance: float = 1.0  # exponential moving average of accepted / proposed per verification
    paused_steps: int = 0

    def record(self, proposed: int, accepted: int, config: SpeculativeConfig) -> None:
        self.acceptance = 0.7 * self.acceptance + 0.3 * (accepted / proposed)
        if self.acceptance < config.min_acceptance:
            self.paused_steps, self.acceptance = config.pause_steps, config.min_acceptance * 2

    def may_propose(self) -> bool:
        if self.paused_steps:
            self.paused_steps -= 1
            return False
        return True
