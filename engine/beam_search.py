"""Beam search as vLLM runs it, in the front end: each step, every live beam is a one-token request for its top
2 * beam_width log-probabilities (the prefix cache holds what the beams share), and the best beam_width continuations
live on. A beam that draws EOS is complete. Beams rank by cumulative log-probability / length ** length_penalty, the
length counting the prompt and not the EOS (vLLM's `get_beam_search_score`). Torch-free."""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import EngineInputError
from engine.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam asks for 2 * beam_width alternatives a step


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, less temperature (the beams rank by the model's own log-probabilities, so a
    temperature could change nothing). `max_tokens` None: the engine's max_tokens policy."""

    beam_width: int
    max_tokens: int | None = 16
    ignore_eos: bool = False  # EOS is a token like any other, and no beam completes before max_tokens
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # a completed beam's tokens end with its EOS (never its text)
    skip_special_tokens: bool = True  # in the text

    def __post_init__(self) -> None:
        if not (isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH):
            raise EngineInputError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}",
                                   "n")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise EngineInputError(f"length_penalty must be a finite number, got {self.length_penalty!r}",
                                   "length_penalty")
        SamplingParams(max_tokens=self.max_tokens)  # the same checks as any request's max_tokens

    def step_params(self) -> SamplingParams:
        """Each beam's one-token request: greedy, so the drawn token is among the alternatives returned."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width, ignore_eos=True)


@dataclass
class Beam:
    tokens: list[int]  # the prompt's, then the output's (as vLLM's BeamSearchSequence)
    cum_logprob: float
    finish_reason: str | None = None  # "stop" at EOS, "length" once the search ends
    text: str = ""  # the output's, set by the front end that decodes it

    def output_token_ids(self, num_prompt_tokens: int) -> list[int]:
        return self.tokens[num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """One prompt's beams, best first (vLLM's BeamSearchOutput)."""

    sequences: list[Beam]
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # the first step's prefix-cache hit, as a request's usage reports it


@dataclass
class BeamSearch:
    prompt_token_ids: list[int]
    params: BeamSearchParams  # max_tokens resolved
    eos_token_ids: frozenset[int]
    live: list[Beam] = field(default_factory=list)
    completed: list[Beam] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        self.live = [Beam(list(self.prompt_token_ids), 0.0)]

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens or self._no_live_beam_can_rank()

    def beam_prompts(self) -> list[list[int]]:
        """The prompt of each live beam's next one-token request, in the order `advance` takes their answers."""
        return [beam.tokens for beam in self.live]

    def advance(self, top_logprobs: list[dict[int, float]]) -> None:
        """One step: each live beam's alternatives (token -> log-probability), in the order of `live`."""
        width, eos = self.params.beam_width, self.eos_token_ids
        candidates: list[tuple[float, int, Beam]] = []
        for beam, alternatives in zip(self.live, top_logprobs, strict=True):
            for token, logprob in alternatives.items():
                score = beam.cum_logprob + logprob
                if token in eos and not self.params.ignore_eos:
                    ended = beam.tokens + [token] if self.params.include_stop_str_in_output else list(beam.tokens)
                    self.completed.append(Beam(ended, score, "stop"))
                else:
                    candidates.append((score, token, beam))
        self.completed = heapq.nlargest(width, self.completed, key=self._score)  # only these can rank
        best = heapq.nlargest(width, candidates, key=lambda c: c[0])
        self.live = [Beam(beam.tokens + [token], score) for score, token, beam in best]
        self.steps += 1

    def best(self) -> list[Beam]:
        """The beam_width best of the completed and live beams, best first; live ones end at "length"."""
        for beam in self.live:
            beam.finish_reason = "length"
        return heapq.nlargest(self.params.beam_width, self.completed + self.live, key=self._score)

    def result(self, decode: Callable[[list[int]], str], num_cached_tokens: int = 0) -> BeamSearchOutput:
        """The best beams, their texts decoded (an EOS never in them)."""
        beams, start = self.best(), len(self.prompt_token_ids)
        for beam in beams:
            ids = beam.output_token_ids(start)
            beam.text = decode(ids[:-1] if beam.finish_reason == "stop" and self.params.include_stop_str_in_output
                               else ids)
        return BeamSearchOutput(beams, self.prompt_token_ids, num_cached_tokens)

    def _score(self, beam: Beam) -> float:
        length = len(beam.tokens) - (beam.finish_reason == "stop" and self.params.include_stop_str_in_output)
        return beam.cum_logprob / (length ** self.params.length_penalty)

    def _no_live_beam_can_rank(self) -> bool:
        """The search may end before max_tokens where it could not change its answer: beam_width completed beams
        each outscore the best any live beam's descendants could reach (log-probabilities only fall; the length
        they divide by grows at most to the last step's)."""
        if len(self.completed) < self.params.beam_width:
            return False
        worst_kept = min(map(self._score, self.completed))
        penalty = self.params.length_penalty
        longest = len(self.prompt_token_ids) + self.params.max_tokens
        reachable = max(beam.cum_logprob / (longest if penalty > 0 else len(beam.tokens)) ** penalty
                        for beam in self.live)
        return worst_kept >= reachable
