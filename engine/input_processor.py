"""The front end's input half: tokenize text, token ids or chat messages, validate a request against the model's
limits, and resolve max_tokens, so the core receives only requests it can run. Thread-safe but for the tokenizer,
which its owner calls from one thread."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Union

from engine import chat
from engine.beam_search import BeamSearch, BeamSearchParams
from engine.config import EngineConfig
from engine.core_messages import EngineRequest, ModelLimits
from engine.errors import EngineInputError
from engine.pooling_params import PoolingParams
from engine.prompt_part import PromptPart
from engine.sampling_defaults import as_params
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarChecker, GrammarCompiler

Messages = chat.Messages
Prompt = Union[str, list[int], Messages, list[PromptPart]]
MAX_CACHE_SALT_CHARS = 256
MAX_PRIORITY = 1 << 31
EMBEDDING_PARAMS = SamplingParams(max_tokens=None, temperature=0.0)  # an embedding request's: nothing is sampled


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, limits: ModelLimits, grammars: GrammarCompiler | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        # an in-process core's compiler, shared; where the core compiles in its own process, a checker of our own
        self.grammars = grammars or GrammarChecker(tokenizer, limits.vocab_size)
        # No token is longer than this many characters, so a longer text cannot fit the context: refused untokenized
        self.max_prompt_chars = limits.max_model_len * max(map(len, tokenizer.get_vocab()))
        # a request given no SamplingParams samples as the model's authors recommend, for as many tokens (vLLM's
        # default sampling params: 16 tokens where the model names no max_new_tokens)
        self.sampling_defaults = as_params(limits.sampling_defaults)  # once: with_defaults runs for every request
        max_tokens = limits.sampling_defaults.get("max_tokens")
        self.default_params = SamplingParams(**self.sampling_defaults,
                                             **({"max_tokens": int(max_tokens)} if max_tokens is not None else {}))

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                arrival_time: float | None = None, cache_salt: str | None = None, tools: list[dict] | None = None,
                prompt_leader: str | None = None, priority: int = 0,
                options: chat.ChatOptions = chat.DEFAULT_OPTIONS, lora_name: str | None = None,
                pooling: PoolingParams | None = None) -> EngineRequest:
        """Validate and tokenize; EngineInputError names the field at fault. With `pooling`, an embedding request
        (no `params`: it samples nothing)."""
        self._check_cache_salt(cache_salt)
        self.check_lora_name(lora_name)
        self._check_priority(priority)
        if pooling is not None:
            return self._embedding_request(request_id, prompt, pooling, arrival_time, cache_salt, priority, options,
                                           lora_name)
        params = params or self.default_params
        self._check_token_ids(params)
        params = self._with_bad_words_tokenized(params)
        token_ids = self.truncated(self.tokenize(prompt, tools, options), params)
        max_tokens = self.validated_max_tokens(len(token_ids), params)
        if params.structured_output is not None:
            self.grammars.check(params.structured_output)  # refuses a schema that cannot compile, here
        return EngineRequest(request_id, token_ids, params, max_tokens,
                             time.monotonic() if arrival_time is None else arrival_time, cache_salt, prompt_leader,
                             priority, lora_name)

    def with_defaults(self, params: SamplingParams, unset: frozenset[str]) -> SamplingParams:
        """`params` with the model's sampling defaults in the fields `unset` names (those its request left unset)."""
        chosen = {name: value for name, value in self.sampling_defaults.items() if name in unset}
        return dataclasses.replace(params, **chosen) if chosen else params

    def beam_search(self, prompt: Prompt, params: BeamSearchParams, cache_salt: str | None = None, priority: int = 0,
                    lora_name: str | None = None) -> BeamSearch:
        """A beam search over the prompt, checked as its steps' requests will be, its max_tokens resolved by the
        one policy (it must fit the context beside the prompt)."""
        self._check_cache_salt(cache_salt)
        self.check_lora_name(lora_name)
        self._check_priority(priority)
        token_ids = self.tokenize(prompt)
        max_tokens = self.validated_max_tokens(len(token_ids), SamplingParams(max_tokens=params.max_tokens))
        return BeamSearch(token_ids, dataclasses.replace(params, max_tokens=max_tokens),
                          frozenset(self.limits.eos_token_ids))

    def _embedding_request(self, request_id: str, prompt: Prompt, pooling: PoolingParams, arrival_time: float | None,
                           cache_salt: str | None, priority: int, options: chat.ChatOptions,
                           lora_name: str | None) -> EngineRequest:
        self.check_dimensions(pooling.dimensions)
        token_ids = self.truncated_for_embedding(self.tokenize(prompt, None, options), pooling)
        return EngineRequest(request_id, token_ids, EMBEDDING_PARAMS, 0,
                             time.monotonic() if arrival_time is None else arrival_time, cache_salt, None, priority,
                             lora_name, pooling)

    def truncated_for_embedding(self, token_ids: list[int], pooling: PoolingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: as many as the context and the KV cache hold), or
        all of it; refused where it cannot fit. Nothing is generated, so a prompt may fill the context."""
        room = min(self.limits.max_model_len, self.limits.kv_capacity_tokens)
        keep = room if pooling.truncate_prompt_tokens == -1 else pooling.truncate_prompt_tokens
        if keep is not None and len(token_ids) > keep:
            token_ids = token_ids[-keep:]
        if len(token_ids) > room:
            raise EngineInputError(f"input has {len(token_ids)} tokens; at most {room} fit this model's context and KV "
                                   "cache (truncate_prompt_tokens keeps the end of it)", "input")
        return token_ids

    def check_dimensions(self, dimensions: int | None) -> None:
        """`dimensions` only where the model was trained to be cut (Matryoshka), and then to a length it knows."""
        size, allowed = self.limits.hidden_size, self.limits.matryoshka_dimensions
        if dimensions is None or dimensions == size:
            return
        if allowed is None:
            raise EngineInputError(f"dimensions: this model was not trained for shortened embeddings (Matryoshka); "
                                   f"its embeddings have {size} dimensions", "dimensions")
        if (allowed and dimensions not in allowed) or not 1 <= dimensions <= size:
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {size}"
            raise EngineInputError(f"dimensions is {dimensions}; this model's embeddings may have {sizes}", "dimensions")

    def tokenize(self, prompt: Prompt, tools: list[dict] | None = None,
                 options: chat.ChatOptions = chat.DEFAULT_OPTIONS) -> list[int]:
        """Token ids of a text, token ids, chat messages (with `tools` offered to the model and the template's
        `options`: chat only) or parts joined."""
        if isinstance(prompt, str):
            if not prompt:
                raise EngineInputError("prompt is empty", "prompt")
            self._check_length(len(prompt), "prompt")
            _check_unicode(prompt, "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self._tokenize_chat(prompt, tools, options)
        if isinstance(prompt, list) and prompt and all(isinstance(p, PromptPart) for p in prompt):
            return self._tokenize_parts(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise EngineInputError("prompt is empty", "prompt")
            self.check_in_vocabulary(prompt, "prompt")
            return list(prompt)
        raise EngineInputError("prompt must be a string, a list of token ids, or a list of chat messages", "prompt")

    def truncated(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: as many as leave room for max_tokens, or one
        token, in the context and the KV cache; its first ones with truncation_side "right"), or all of it."""
        keep = params.truncate_prompt_tokens
        if keep == -1:
            room = min(self.limits.max_model_len, self.limits.kv_capacity_tokens)
            keep = room - (params.max_tokens or 1)
        if keep is None or len(token_ids) <= keep:
            return token_ids
        if keep < 1:
            raise EngineInputError(f"max_tokens is {params.max_tokens}: no prompt fits beside it in the model's context "
                                   f"of {self.limits.max_model_len}", "max_tokens")
        return token_ids[:keep] if params.truncation_side == "right" else token_ids[-keep:]

    def check_in_vocabulary(self, token_ids: list[int], param: str) -> None:
        """EngineInputError naming `param` for the first id outside [0, vocab_size)."""
        vocab = self.limits.vocab_size
        outside = next((t for t in token_ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise EngineInputError(f"{param}: token id {outside} is outside the vocabulary [0, {vocab})", param)

    def _tokenize_parts(self, parts: list[PromptPart]) -> list[int]:
        token_ids: list[int] = []
        for part in parts:
            if isinstance(part.content, str):
                self._check_length(len(part.content), part.param)
                _check_unicode(part.content, part.param)
                token_ids += self.tokenizer.encode(part.content, add_special_tokens=part.special_tokens)
            else:
                self.check_in_vocabulary(part.content, part.param)
                token_ids += part.content
        if not token_ids:
            raise EngineInputError("the prompt is empty", parts[0].param)
        return token_ids

    def _tokenize_chat(self, messages: Messages, tools: list[dict] | None, options: chat.ChatOptions) -> list[int]:
        messages = chat.normalize(messages)
        content = sum(len(m["content"]) for m in messages)
        self._check_length(content, "messages")
        for i, message in enumerate(messages):
            _check_unicode(message["content"], f"messages[{i}].content")
        # before the template renders and encodes them in one call: the tools and documents it writes out too
        extra = len(json.dumps(tools or [])) + len(json.dumps(options.documents or []))
        self._check_length(content + extra, "messages")
        return chat.encode(self.tokenizer, messages, tools, options, self.config.sanitize_control_tokens)

    def _check_length(self, num_chars: int, param: str) -> None:
        """Before tokenizing: a text that cannot fit is refused without the cost of encoding it."""
        if num_chars > self.max_prompt_chars:
            raise EngineInputError(f"the prompt has {num_chars} characters; no more than {self.max_prompt_chars} "
                                   f"can fit the model's context of {self.limits.max_model_len} tokens", param)

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.limits.vocab_size
        if params.allowed_token_ids is not None and len(params.allowed_token_ids) > vocab:  # the core sorts them
            raise EngineInputError(f"allowed_token_ids: at most {vocab} ids, the vocabulary's size", "allowed_token_ids")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("constrain_after", params.constrain_after or ()),
                          ("logprob_token_ids", params.logprob_token_ids or ()),
                          ("thinking_token_budget", _markers(params.thinking_budget))):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise EngineInputError(f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab})", name)

    def _with_bad_words_tokenized(self, params: SamplingParams) -> SamplingParams:
        """vLLM's rule: each word's tokens as written (leading spaces dropped), and with one leading space where
        that gives as many tokens, the first of them different (a word inside a sentence)."""
        if not params.bad_words:
            return params
        words: list[tuple[int, ...]] = []
        for word in params.bad_words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            words.append(bare)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                words.append(spaced)
        return dataclasses.replace(params, bad_words_token_ids=tuple(words))

    def check_lora_name(self, lora_name: str | None) -> None:
        if lora_name is None or self.config.lora_path(lora_name) is not None:
            return
        served = [repr(module.name) for module in self.config.lora_modules]
        served += ["those under its lora_root"] if self.config.lora_root is not None else []
        said = f"its adapters are {' and '.join(served)}" if served else "it serves no adapter"
        raise EngineInputError(f"lora_name {str(lora_name)[:256]!r} is not a LoRA adapter of this engine; {said}",
                               "lora_name")

    def _check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool) or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise EngineInputError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]", "priority")
        if priority and self.config.scheduling_policy != "priority":
            raise EngineInputError(f"priority is {priority}, but this server schedules first come, first served "
                                   "(scheduling_policy fcfs): only 0 is served", "priority")

    @staticmethod
    def _check_cache_salt(salt: str | None) -> None:
        if salt is None:
            return
        if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
            raise EngineInputError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters", "cache_salt")
        _check_unicode(salt, "cache_salt")

    def validated_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The one max_tokens policy: a default of the rest of the context (or default_max_tokens), and a limit
        that caps the default and refuses a larger explicit value."""
        context, limit = self.limits.max_model_len, self.config.max_tokens_limit
        if num_prompt_tokens >= context:
            raise EngineInputError(f"prompt has {num_prompt_tokens} tokens; the model's context is {context}", "prompt")
        capacity = self.limits.kv_capacity_tokens
        if num_prompt_tokens >= capacity:
            raise EngineInputError(f"prompt has {num_prompt_tokens} tokens; the KV cache holds {capacity}", "prompt")
        remaining = context - num_prompt_tokens
        if params.max_tokens is None:
            default = self.config.default_max_tokens or self.limits.sampling_defaults.get("max_tokens")
            return min(int(default or remaining), limit or remaining, remaining)
        if limit is not None and params.max_tokens > limit:
            raise EngineInputError(f"max_tokens is {params.max_tokens}; this server allows at most {limit}", "max_tokens")
        if num_prompt_tokens + params.max_tokens > context:
            raise EngineInputError(
                f"prompt has {num_prompt_tokens} tokens and max_tokens is {params.max_tokens}; "
                f"together they exceed the model's context of {context}", "max_tokens")
        return params.max_tokens


def _markers(budget) -> tuple[int, ...]:
    return budget.start + budget.end if budget is not None else ()


def _check_unicode(text: str, param: str) -> None:
    """A lone surrogate is valid JSON but no tokenizer or encoder takes it: refused, naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EngineInputError(f"{param} is not valid Unicode (a lone surrogate at character {exc.start})", param)
