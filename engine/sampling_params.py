"""SamplingParams: what a request asks of the sampler and the stop checks. Torch-free."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineInputError
from engine.repetition import RepetitionDetection
from engine.thinking_budget import ThinkingBudget

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # a stream holds back this much text to catch a stop string split across deltas
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's own bound
MAX_BAD_WORDS = 128
# tokens in all of a request's bad words (each as written and after a space): the bans are checked every step
MAX_BAD_WORD_TOKENS = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_REPETITION_PENALTY = 2.0
# A floor far from where dividing a positive logit by the penalty overflows to inf and the softmax gives NaN (a fuzzed
# 1.7e-149 did); at 0.01 a logit grows a hundredfold at most
MIN_REPETITION_PENALTY = 0.01
# Temperatures below this are greedy, as in vLLM: dividing logits by 1e-40 overflows to inf, and the softmax to NaN.
SAMPLING_EPS = 1e-5
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts
# Every other integer field travels to the core in msgpack, which holds 64 bits: a fuzzed rerank request's
# truncate_prompt_tokens of 10^30 failed its encoding, a 500, where it must be a 400 naming the field
INT64_RANGE = (-(1 << 63), 1 << 63)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_int64(value) -> bool:
    """An int (not a bool) that a signed 64-bit field holds."""
    return _is_int(value) and INT64_RANGE[0] <= value < INT64_RANGE[1]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
    prompt_logprobs: int | None = None  # like logprobs, for every prompt token but the first; skips the prefix cache
    repetition_penalty: float = 1.0  # HF's rule over prompt and output tokens: positive logits divided, negative multiplied
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings are held off until this many tokens exist
    logit_bias: dict[int, float] | None = None  # added to the logits before anything else
    structured_output: "StructuredOutput | None" = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # a stop string ends the text after itself instead of before
    # keep only the prompt's last k tokens; -1: as many as fit the context beside max_tokens (vLLM's field)
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"  # "left" keeps the prompt's last k tokens, "right" its first k (vLLM's field)
    allowed_token_ids: list[int] | None = None  # the only tokens the output may hold (vLLM's field)
    # never generated (vLLM's rule): a word's last token is banned where the output ends with the tokens before it
    bad_words: list[str] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None  # the input processor's tokenization of bad_words
    # the structured output applies once the output holds these tokens (a reasoning model's end of thinking, as
    # vLLM's reasoning parsers let the model think freely first); None: from the first token
    constrain_after: tuple[int, ...] | None = None
    # end the output, finish reason "repetition", once it ends in a pattern repeated so (vLLM's repetition_detection)
    repetition_detection: RepetitionDetection | None = None
    # vLLM's: each output token's logprobs are these ids' (beside the chosen token's), not the most likely ones; sets
    # logprobs to 0 where it is None
    logprob_token_ids: list[int] | None = None
    # vLLM's thinking_token_budget: a thinking section's end marker is forced once the section holds this many tokens
    thinking_budget: ThinkingBudget | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        if self.logprob_token_ids is not None and self.logprobs is None:
            self.logprobs = 0  # the sampler's logprob rows are those that set logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        def bad(message: str, param: str) -> None:
            raise EngineInputError(message, param)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not _is_number(getattr(self, name)):
                bad(f"{name} must be a finite number, got {getattr(self, name)!r}", name)
        # bounded below: seed by SEED_RANGE, max_tokens by the context in the input processor (which names the limit)
        for name in ("seed", "max_tokens"):
            if getattr(self, name) is not None and not _is_int(getattr(self, name)):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}", name)
        for name in ("logprobs", "prompt_logprobs", "min_tokens", "truncate_prompt_tokens"):
            if getattr(self, name) is not None and not is_int64(getattr(self, name)):
                bad(f"{name} must be a 64-bit integer, got {getattr(self, name)!r}", name)
        if not is_int64(self.top_k):
            bad(f"top_k must be a 64-bit integer, got {self.top_k!r}", "top_k")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            bad(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}",
                "truncate_prompt_tokens")
        if self.truncation_side not in ("left", "right"):
            bad(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}", "truncation_side")
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
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            bad(f"seed must be a 64-bit integer, in [-2**63, 2**64), got {self.seed}", "seed")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            bad(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}", "prompt_logprobs")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty}", "repetition_penalty")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", "min_tokens")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            bad("structured_output must be a StructuredOutput", "response_format")
        if self.repetition_detection is not None and not isinstance(self.repetition_detection, RepetitionDetection):
            bad("repetition_detection must be a RepetitionDetection", "repetition_detection")
        if self.thinking_budget is not None and not isinstance(self.thinking_budget, ThinkingBudget):
            bad("thinking_budget must be a ThinkingBudget", "thinking_token_budget")
        self._validate_logit_bias(bad)
        self._validate_logprob_token_ids(bad)
        self._validate_stops(bad)
        self._validate_vocabulary_limits(bad)

    @property
    def draws_from_logits_alone(self) -> bool:
        """Whether a token's draw needs nothing on the host but the row's logits (async scheduling may launch the
        step after it first): no penalties (the history), logprobs, logit bias, restricted vocabulary, prompt
        logprobs. A thinking budget's rows fly while its countdown forces nothing soon (async_scheduling.flies)."""
        return not (self.has_penalties or self.logprobs is not None or self.logit_bias or self.restricts_vocabulary
                    or self.prompt_logprobs is not None)

    @property
    def restricts_vocabulary(self) -> bool:
        """Whether the sampler must mask tokens beyond logit_bias: allowed_token_ids or bad_words."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    def _validate_logit_bias(self, bad) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            bad(f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases", "logit_bias")
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                bad(f"logit_bias keys must be token ids (non-negative integers), got {token!r}", "logit_bias")
            if not _is_number(bias) or not low <= bias <= high:
                bad(f"logit_bias values must be numbers in [{low:g}, {high:g}], got {bias!r} for token {token}", "logit_bias")

    def _validate_logprob_token_ids(self, bad) -> None:
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not isinstance(ids, list) or not 0 < len(ids) <= MAX_LOGPROB_TOKEN_IDS or not all(
                _is_int(t) and t >= 0 for t in ids):
            bad(f"logprob_token_ids must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids", "logprob_token_ids")
        if self.logprobs not in (None, 0, len(ids)):  # vLLM's rule; 0 is what None becomes
            bad(f"logprobs and logprob_token_ids: the listed ids take the top ones' place, so logprobs must be unset "
                f"or {len(ids)}, got {self.logprobs}", "logprob_token_ids")

    def _validate_vocabulary_limits(self, bad) -> None:
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, list) or not all(
                _is_int(t) and t >= 0 for t in self.allowed_token_ids) or not self.allowed_token_ids):
            bad("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            bad(f"bad_words must be at most {MAX_BAD_WORDS} strings, each with a non-space character", "bad_words")
        if self.bad_words is not None and any(len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words):
            bad(f"a bad word may have at most {MAX_STOP_STRING_CHARS} characters", "bad_words")
        after = self.constrain_after
        if after is not None and (not isinstance(after, tuple) or not 0 < len(after) <= MAX_STOP_TOKEN_IDS
                                  or not all(_is_int(t) and t >= 0 for t in after)):
            bad(f"constrain_after must be 1 to {MAX_STOP_TOKEN_IDS} token ids", "constrain_after")
        words = self.bad_words_token_ids
        if words is not None and (sum(map(len, words)) > MAX_BAD_WORD_TOKENS or not all(
                word and all(_is_int(t) and t >= 0 for t in word) for word in words)):
            bad(f"bad_words may hold at most {MAX_BAD_WORD_TOKENS} tokens in all (each word counted as written and "
                "after a space)", "bad_words")

    def _validate_stops(self, bad) -> None:
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop_strings)}", "stop")
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            bad("stop strings must be non-empty strings", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop_strings):
            bad(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}", "stop_token_ids")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers", "stop_token_ids")


# json.dumps's separators: what models write unprompted. Fixed whitespace also keeps a small model from looping on
# newlines inside an object, which flexible whitespace allows. Grammars and forced tool calls both write JSON so.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


MAX_CHOICES = 1024  # structured output's `choice`: each is an alternative of one grammar rule
# Subschemas (JSON objects) in one JSON schema: each can be a level of llguidance's recursive compile, whose stack
# engine/structured_output.py sizes for this many. A schema's $refs chain without nesting its text, so the text's
# own nesting bound does not bound them.
MAX_SCHEMA_NODES = 10_000
MAX_WHITESPACE_PATTERN_CHARS = 256


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output: to a JSON schema, to any JSON object, to a grammar (Lark, llguidance's dialect that
    embeds JSON schemas, or GBNF/EBNF as llama.cpp and vLLM write them), to a regular expression, or to one of a list
    of strings. Compiled once per distinct value. `param` is the request field it came from, named in refusals."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    grammar: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    param: str = "response_format"
    # JSON only: the whitespace JSON may hold around its punctuation, a regular expression (vLLM's whitespace_pattern,
    # as outlines read it); None: JSON_OPTIONS' fixed ", " and ": "
    whitespace_pattern: str | None = None
    whitespace_param: str = "whitespace_pattern"  # the request field that set it, named in refusals

    def __post_init__(self) -> None:
        kinds = (self.json_schema is not None) + self.json_object + sum(
            value is not None for value in (self.grammar, self.regex, self.choice))
        if kinds != 1:
            raise EngineInputError("structured output needs exactly one of json_schema, json_object, grammar, regex "
                                   "or choice", self.param)
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise EngineInputError(f"{self.param}: a JSON schema must be a JSON object", self.param)
        if self.json_schema is not None and count_objects(self.json_schema) > MAX_SCHEMA_NODES:
            raise EngineInputError(f"{self.param}: a JSON schema may hold at most {MAX_SCHEMA_NODES} objects", self.param)
        for text in (self.grammar, self.regex):
            if text is not None and (not isinstance(text, str) or not text):
                raise EngineInputError(f"{self.param}: a grammar or regex must be a non-empty string", self.param)
        if self.choice is not None and not (
                0 < len(self.choice) <= MAX_CHOICES and all(isinstance(c, str) and c for c in self.choice)):
            raise EngineInputError(f"{self.param}: choice must be 1 to {MAX_CHOICES} non-empty strings", self.param)
        if self.whitespace_pattern is not None:
            self._check_whitespace_pattern()

    def _check_whitespace_pattern(self) -> None:
        param = self.whitespace_param
        if self.json_schema is None and not self.json_object:
            raise EngineInputError(f"{param} applies to a JSON constraint (a schema or json_object) only", param)
        if not isinstance(self.whitespace_pattern, str) or len(self.whitespace_pattern) > MAX_WHITESPACE_PATTERN_CHARS:
            raise EngineInputError(f"{param} must be a regular expression of at most {MAX_WHITESPACE_PATTERN_CHARS} "
                                   "characters", param)

    @property
    def json_options(self) -> dict[str, Any]:
        """llguidance's layout of this constraint's JSON: JSON_OPTIONS, or bare separators with the pattern's
        whitespace around them."""
        if self.whitespace_pattern is None:
            return JSON_OPTIONS
        return {"item_separator": ",", "key_separator": ":", "whitespace_pattern": self.whitespace_pattern}

    @property
    def key(self) -> str:
        """A canonical text of the constraint: the grammar cache's key. A JSON schema's starts with '{', no other's."""
        if self.grammar is not None:
            return f"grammar:{self.grammar}"
        if self.regex is not None:
            return f"regex:{self.regex}"
        if self.choice is not None:
            return f"choice:{json.dumps(self.choice)}"
        key = json.dumps(self.json_schema, sort_keys=True) if self.json_schema is not None else "{json_object}"
        return key if self.whitespace_pattern is None else f"{key}\nwhitespace:{self.whitespace_pattern}"


def count_objects(value: Any) -> int:
    """JSON objects in a JSON value, itself included; walked with a stack, and stopping past MAX_SCHEMA_NODES."""
    count, stack = 0, [value]
    while stack and count <= MAX_SCHEMA_NODES:
        item = stack.pop()
        if isinstance(item, dict):
            count += 1
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count
