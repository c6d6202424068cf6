"""SamplingParams: what a request asks of the sampler and the stop checks. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import EngineInputError

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        def bad(message: str, param: str) -> None:
            raise EngineInputError(message, param)

        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)):
            bad(f"max_tokens must be an integer, got {self.max_tokens!r}", "max_tokens")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not self.temperature >= 0.0:
            bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k == 0 or self.top_k < -1:
            bad(f"top_k must be -1 (off) or >= 1, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop_strings)}", "stop")
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            bad("stop strings must be non-empty strings", "stop")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}", "seed")
