"""Stopping on a repeated token pattern, vLLM's repetition detection: an output ends (finish reason "repetition")
once, for some length p in [min_pattern_size, max_pattern_size], its last p tokens have appeared min_count times in
a row at its end ("abcabcabc": p 3, count 3). Only output tokens count; the check waits for min_tokens. Torch-free.

The core keeps, per period p, how many tokens in a row at the output's end equal the token p before them (the pattern
of length p repeats c times exactly when that run reaches p * (c - 1)). A new token extends the runs of the periods
whose earlier token it equals, found by a C-level scan of the window, and ends every other: a step costs the window's
scan plus one dict entry per match, where rechecking every period from the end (vLLM's way) costs a Python loop over
every period, every token. Periods too long to come min_count times within the request's max_tokens are never
scanned."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import EngineInputError

# Bounds the scan and the runs kept per row (a window this long, each token): a pattern longer than this is text
# repeated, not a loop the model is stuck in
MAX_PATTERN_SIZE = 1024
MAX_COUNT = 1 << 31
# what the errors name: the request's field, as vLLM's OpenAI server spells it
PARAMS = {name: f"repetition_detection.{name}" for name in ("max_pattern_size", "min_pattern_size", "min_count")}


@dataclass(frozen=True)
class RepetitionDetection:
    """vLLM's RepetitionDetectionParams: stop once a pattern of min..max tokens has repeated min_count times."""

    max_pattern_size: int
    min_pattern_size: int = 1
    min_count: int = 2

    def __post_init__(self) -> None:
        for name, param in PARAMS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise EngineInputError(f"{param} must be an integer, got {value!r}", param)
        bounds = {"max_pattern_size": (1, MAX_PATTERN_SIZE), "min_pattern_size": (1, self.max_pattern_size),
                  "min_count": (2, MAX_COUNT)}
        for name, (low, high) in bounds.items():  # in this order: each bound leans on the one before
            if not low <= getattr(self, name) <= high:
                raise EngineInputError(f"{PARAMS[name]} must be in [{low}, {high}] to detect repetition, got "
                                       f"{getattr(self, name)}", PARAMS[name])


@dataclass
class RepetitionRuns:
    """One request's runs, advanced by each token appended to its output."""

    rule: RepetitionDetection
    longest: int  # the longest period that can still come min_count times within the request's max_tokens
    runs: dict[int, int] = field(default_factory=dict)  # period -> tokens in a row equal to the one `period` before

    @classmethod
    def within(cls, rule: RepetitionDetection, max_tokens: int) -> RepetitionRuns | None:
        """The runs of an output of at most max_tokens, or None where no pattern of the rule fits min_count times:
        a huge min_count scans nothing, where vLLM bounds it by the output so far."""
        longest = min(rule.max_pattern_size, max_tokens // rule.min_count)
        return cls(rule, longest) if longest >= rule.min_pattern_size else None

    def append(self, tokens: list[int], output_start: int) -> bool:
        """Account for tokens[-1], just appended (tokens[output_start:] is the output); whether the output now ends
        in a pattern repeated min_count times."""
        rule, end = self.rule, len(tokens) - 1
        last, runs, extended = tokens[end], self.runs, {}
        repeats = rule.min_count - 1
        found = False
        # the earlier token of period p sits at end - p: p in [min, longest], in the output
        position, stop = max(output_start, end - self.longest), end - rule.min_pattern_size + 1
        while position < stop:
            try:
                position = tokens.index(last, position, stop)
            except ValueError:
                break
            period = end - position
            run = extended[period] = runs.get(period, 0) + 1
            found = found or run >= period * repeats
            position += 1
        self.runs = extended
        return found
