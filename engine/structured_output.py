"""Structured output on llguidance: a JSON schema, any JSON object, a grammar (Lark or GBNF), a regular expression
or a choice of strings becomes a token mask for the sampler.

Each distinct constraint is compiled once into a template matcher; a request gets a cheap deep copy (tens of
microseconds). A mask costs about 0.1-0.2 ms a token on this CPU, computed only for the rows that carry a grammar,
and applied inside the batched sampler, so other requests in the step pay nothing for it.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from engine.errors import EngineInputError
from engine.sampler import GrammarMask
from engine.sampling_params import StructuredOutput

# Bounds on what one grammar may cost (llguidance's defaults allow 14 ms of lexer work per token and row): a client's
# schema taxes every step its request is in, so each mask step gets about 3 ms at most. verbose_errors off: error
# messages would quote the schema into logs.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=50_000, step_max_items=20_000, max_grammar_size=100_000,
              verbose_errors=False)

ANY_JSON_OBJECT = {"type": "object"}
# llguidance compiles recursively on its caller's stack, a level or more per subschema: a JSON schema whose $refs
# chained ~1,300 deep overflowed a thread's default 8 MB and killed the process with a segfault, no exception to
# catch (and a Lark rule chain ~2,500 deep). Checks and compiles run on a thread of their own with this much stack
# (address space: only the pages a compile touches are ever backed); MAX_SCHEMA_NODES (sampling_params) bounds how
# deep a schema can make them go, with room to spare at the ~7 KB a level measured.
COMPILE_STACK_BYTES = 256 << 20
_stack_size_lock = threading.Lock()
BITS = torch.arange(32, dtype=torch.int32)


class _Grammars:
    """Constraints against the model's tokenizer: llguidance's view of it, and the check that a constraint compiles
    within LIMITS. Keeps the last `cache_size` distinct constraints it has seen. Thread-safe: requests are checked on
    callers' threads."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 128):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._ll_tokenizer = None  # built on first use: it takes about a second
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # the cache
        self._tokenizer_lock = threading.Lock()

    @property
    def warm(self) -> bool:
        return self._ll_tokenizer is not None

    def warm_up(self) -> None:
        """Build llguidance's view of the tokenizer (about a second, much of it holding the interpreter lock), so
        that no request pays for it in a step while others wait."""
        self._tokenizer()

    def _cached(self, key: str):
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
            return entry

    def _keep(self, key: str, entry) -> None:
        with self._lock:
            self._cache[key] = entry
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _validated(self, spec: StructuredOutput):
        """`spec`'s grammar, checked to compile within LIMITS (a third of a compile's time); EngineInputError if not."""
        return on_a_large_stack(self._validate, spec)

    def _validate(self, spec: StructuredOutput):
        from llguidance import LLMatcher, LLParserLimits

        if spec.whitespace_pattern is not None:
            self._check_whitespace(spec)
        try:
            grammar = _grammar(spec)
        except ValueError as exc:
            raise EngineInputError(f"{spec.param}: {_WHAT[_kind(spec)]} is not valid ({_short(str(exc))})", spec.param)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer(),
                                                                      limits=LLParserLimits(**LIMITS))
        if is_error:
            raise EngineInputError(f"{spec.param}: the constraint cannot be compiled: {_short(messages[0])}", spec.param)
        return grammar

    def _check_whitespace(self, spec: StructuredOutput) -> None:
        """A whitespace pattern that is no regular expression, refused by its own field."""
        from llguidance import LLMatcher

        try:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(
                LLMatcher.grammar_from_regex(spec.whitespace_pattern), self._tokenizer())
        except ValueError as exc:
            is_error, messages = True, [str(exc)]
        if is_error:
            raise EngineInputError(f"{spec.whitespace_param}: not a valid regular expression ({_short(messages[0])})",
                                   spec.whitespace_param)

    def _tokenizer(self):
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer


class GrammarChecker(_Grammars):
    """A front end's, where the core compiles in a process of its own: refuses a constraint that cannot compile
    before it is admitted, and compiles nothing (the core's compile is the one that is used)."""

    def check(self, spec: StructuredOutput) -> None:
        if self._cached(spec.key) is None:
            self._validated(spec)
            self._keep(spec.key, True)


class GrammarCompiler(_Grammars):
    """Compiles constraints into template matchers, caching them; a request gets a copy of its template."""

    def check(self, spec: StructuredOutput) -> None:
        """Refuse what cannot compile, compiling it into the cache (an in-process core's step would compile it)."""
        self.prepare(spec)

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher at the start of `spec`'s grammar; EngineInputError if the schema cannot compile."""
        return self.prepare(spec).deep_copy()

    def forget(self, spec: StructuredOutput) -> None:
        """Drop `spec`'s template after a request failed on it: a template's copies share its lexer (llguidance), so
        one that ran into the lexer's limits leaves every later copy failing at its first token; a fresh compile
        starts over."""
        with self._lock:
            self._cache.pop(spec.key, None)

    def is_compiled(self, spec: StructuredOutput) -> bool:
        with self._lock:
            return spec.key in self._cache

    def prepare(self, spec: StructuredOutput):
        """Compile `spec` into the cache, if it is not there yet (tens of ms, up to a second for a large schema:
        callers that must not block call this on a worker thread first), and return its template matcher. The lock
        guards the cache only, never a compile: a step loop asking `is_compiled` must not wait for one."""
        template = self._cached(spec.key)
        if template is None:
            template = self._compile(spec)  # two threads may compile one spec at once; either result serves
            self._keep(spec.key, template)
        return template

    def _compile(self, spec: StructuredOutput):
        return on_a_large_stack(self._compile_here, spec)

    def _compile_here(self, spec: StructuredOutput):
        from llguidance import LLMatcher, LLParserLimits

        grammar = self._validate(spec)
        matcher = LLMatcher(self._tokenizer(), grammar, log_level=0, limits=LLParserLimits(**LIMITS))  # drops the GIL
        if matcher.is_error():
            raise EngineInputError(f"{spec.param}: the constraint cannot be compiled: {_short(matcher.get_error())}",
                                   spec.param)
        return matcher


def on_a_large_stack(work, *args):
    """`work(*args)` on a new thread with COMPILE_STACK_BYTES of stack, its result or exception passed on; the caller
    waits (llguidance drops the interpreter lock while it compiles). About 0.1 ms a call, against a compile's
    milliseconds; a constraint already compiled or checked never gets here."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = work(*args)
        except BaseException as exc:  # passed on to the caller, whatever it is
            outcome["error"] = exc

    with _stack_size_lock:  # the size is process-wide, read when a thread starts
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-stack", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _short(message: str, limit: int = 400) -> str:
    """llguidance's message, cut: its compile errors quote the grammar around the fault, up to all of it."""
    return message if len(message) <= limit else message[:limit] + " ..."


_WHAT = {"grammar": "the grammar", "regex": "the regular expression", "choice": "the choice",
         "json": "the JSON schema"}


def _kind(spec: StructuredOutput) -> str:
    return next((kind for kind in ("grammar", "regex", "choice") if getattr(spec, kind) is not None), "json")


def _grammar(spec: StructuredOutput) -> str:
    """llguidance's grammar of `spec`; ValueError if its text does not parse."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind = _kind(spec)
    if kind == "grammar":
        try:
            lark = any_to_lark(spec.grammar)  # Lark passes through; GBNF (vLLM's and llama.cpp's dialect) converts
        except Exception as exc:  # the converter raises its own error classes
            raise ValueError(str(exc)) from None
        return LLMatcher.grammar_from_lark(lark)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":  # one rule of literal alternatives; JSON's string escapes are Lark's
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return LLMatcher.grammar_from_json_schema(spec.json_schema or ANY_JSON_OBJECT, defaults=spec.json_options)


def allowed_tokens(matchers: list, vocab_size: int, device: torch.device) -> GrammarMask | None:
    """Which tokens each row with a grammar allows next, for those rows only; None when no row has one."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return None
    # llguidance.torch's two helpers, inline: importing that module compiles its mask kernel with torch.compile,
    # which imports dynamo and inductor (2.4 s at every core start with torch 2.13) for code the engine never calls
    bitmask = torch.full((len(rows), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for j, row in enumerate(rows):
        matchers[row].unsafe_compute_mask_ptr(bitmask[j].data_ptr(), bitmask.shape[1] * bitmask.element_size())
    if device.type != "cpu":  # the packed words cross to the device (32x smaller than the mask), unpacked there
        bitmask = bitmask.pin_memory().to(device, non_blocking=True)
    bits = (bitmask[:, :, None] >> BITS.to(device, non_blocking=True)) & 1
    return GrammarMask(rows, bits.view(len(rows), -1)[:, :vocab_size].bool())
