"""A sequence's speculative-decoding state: how many drafts to propose next and how well they have been accepted.
Apart from `speculative.py`, which reads sequences, so that `sequence.py` holding one imports nothing back."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import SpeculativeConfig


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
