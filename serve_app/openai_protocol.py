"""The OpenAI requests we accept. An OpenAI field we do not implement is refused with a 400 that names it; fields
outside OpenAI's API (and vLLM's extensions we implement) are ignored."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serve_app.security import REQUEST_ID

from engine.chat import ChatOptions
from engine.errors import EngineInputError
from engine.repetition import MAX_COUNT, MAX_PATTERN_SIZE, PARAMS, RepetitionDetection
from engine.sampling_params import (MAX_BAD_WORDS, MAX_CHOICES, MAX_LOGPROB_TOKEN_IDS, MAX_LOGPROBS,
                                    MAX_REPETITION_PENALTY, MAX_SCHEMA_NODES,
                                    MAX_WHITESPACE_PATTERN_CHARS, MIN_REPETITION_PENALTY, StructuredOutput,
                                    count_objects)

MAX_TOOLS = 128  # OpenAI's own bound
MAX_PROMPTS = 64  # a completion's batch of prompts; each prompt's n choices are engine requests of their own
MAX_DOCUMENTS = 256  # a chat's RAG documents (the body limit bounds their text)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]  # OpenAI's values
MAX_CONSTRAINT_CHARS = 100_000  # a grammar's or a regex's text (llguidance bounds the compiled grammar's size too)
Constraint = Field(default=None, min_length=1, max_length=MAX_CONSTRAINT_CHARS)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a few options, each served or refused: never one ignored
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far on every chunk too
    include_obfuscation: Literal[False] = False  # OpenAI's padding of chunks; not served

    @property
    def usage_on_every_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


def check_unicode(body: Any) -> None:
    """A 400 naming the first string of a request body that is not valid Unicode (a lone surrogate)."""
    path = find_unencodable(body)
    if path is not None:
        raise PydanticCustomError("unicode", "not valid Unicode (it holds a lone surrogate)", {"path": path})


def find_unencodable(value: Any, path: str = "") -> str | None:
    """The path of the first string in a JSON value that is not valid Unicode (JSON may carry lone surrogates,
    which no tokenizer or response encoder accepts), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = find_unencodable(key, path) or find_unencodable(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = find_unencodable(item, f"{path}[{i}]")
            if found:
                return found
    return None


def refuse(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"not supported by this server: {why}", {"path": field})


def refuse_asked(data: dict, unsupported: dict[str, tuple[tuple, str]]) -> None:
    """Refuse the first field of `unsupported` (field -> (the values that ask for nothing, why refused)) that a
    request body sets to anything else."""
    for field, (nothing, why) in unsupported.items():
        if field in data and data[field] not in nothing:
            raise refuse(field, why)


def refuse_tool_kinds(data: dict, served: tuple, what: str) -> None:
    """Refuse the first of a body's `tools` whose type is not among `served` (e.g. a hosted search tool), by index."""
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, dict) and tool.get("type") not in served:
            raise refuse(f"tools.{i}", f"{tool.get('type')!r} tools ({what} are served)")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing", "type json_schema needs a json_schema", {"path": "response_format.json_schema"})
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.type == "json_schema":
            return StructuredOutput(json_schema=self.json_schema.schema_ or {"type": "object"})
        return None


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a JSON schema in which every object that does not say whether it allows properties beyond its own
    allows none (vLLM's `disable_additional_properties`). Walked with a stack: a client's nesting is no recursion."""
    root = json.loads(json.dumps(schema))
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return root


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one constraint of json, regex, choice, grammar (GBNF or Lark) or json_object.
    A key vLLM does not have is refused (its own docs once spelled `choice` as `choices`)."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = Constraint
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Constraint
    json_object: bool | None = None
    disable_fallback: bool = False  # nothing falls back: a constraint that cannot compile is a 400
    disable_any_whitespace: bool = False  # JSON is always written without free whitespace (", " and ": ")
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = Field(default=None, max_length=MAX_WHITESPACE_PATTERN_CHARS, description=(
        "JSON only: the whitespace allowed around its punctuation, a regular expression (default: ', ' and ': ')"))
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> "StructuredOutputs":
        if self.structural_tag is not None:
            raise refuse("structured_outputs.structural_tag", "structural tags")
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise refuse("structured_outputs.whitespace_pattern", "a whitespace pattern beside disable_any_whitespace")
        given = [name for name in ("json", "regex", "choice", "grammar") if self.given(name)]
        if len(given) + bool(self.json_object) != 1:
            raise PydanticCustomError("constraint", "give exactly one of json, regex, choice, grammar or json_object, "
                                      "got {given}", {"given": given + (["json_object"] if self.json_object else [])})
        return self

    def given(self, name: str) -> bool:
        return getattr(self, "json_" if name == "json" else name) is not None

    def structured_output(self) -> StructuredOutput:
        kind = next(name for name in ("json", "regex", "choice", "grammar") if self.given(name)) \
            if not self.json_object else "json_object"
        value = getattr(self, "json_" if kind == "json" else kind)
        spec = constraint(kind, value, f"structured_outputs.{kind}", self.disable_additional_properties)
        return spec if self.whitespace_pattern is None else with_whitespace(spec, self.whitespace_pattern,
                                                                           "structured_outputs.whitespace_pattern")


def with_whitespace(spec: StructuredOutput, pattern: str, param: str) -> StructuredOutput:
    """`spec` with vLLM's whitespace pattern; EngineInputError naming `param` where it is no JSON constraint."""
    return replace(spec, whitespace_pattern=pattern, whitespace_param=param)


def constraint(kind: str, value: Any, param: str, closed: bool = False) -> StructuredOutput:
    """The engine's constraint for one of vLLM's kinds (json, regex, choice, grammar, json_object), naming `param`
    in refusals; EngineInputError when a JSON schema given as text is not one."""
    if kind == "json_object":
        return StructuredOutput(json_object=True, param=param)
    if kind == "choice":
        return StructuredOutput(choice=tuple(value), param=param)
    if kind in ("regex", "grammar"):
        return StructuredOutput(**{kind: value}, param=param)
    schema = value
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):  # nesting past the parser's depth is no schema either
            schema = None
    if not isinstance(schema, dict):
        raise EngineInputError(f"{param}: a JSON schema must be an object, or the JSON text of one", param)
    return StructuredOutput(json_schema=closed_objects(schema) if closed else schema, param=param)


# vLLM's fields before 0.12 (clients still send them): each is the structured_outputs key of the same name
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


# vLLM's request fields this server does not implement: field -> (the values that ask for nothing, why refused)
UNSUPPORTED_VLLM_FIELDS: dict[str, tuple[tuple, str]] = {
    "spaces_between_special_tokens": ((True, None), "spaces_between_special_tokens false"),
    "logits_processors": ((None, []), "custom logits processors"),
    "kv_transfer_params": ((None,), "disaggregated prefill (kv_transfer_params)"),
    "vllm_xargs": ((None,), "vllm_xargs (no custom extensions are installed)"),
    "prompt_embeds": ((None,), "prompt embeddings"),
    "mm_processor_kwargs": ((None,), "multimodal input"),
    "chat_template": ((None,), "a chat template per request (the server's is used: engine_config.chat_template, "
                               "else the model's)"),
    "watermarking": ((None, False), "watermarking"),
    "return_token_offsets": ((None, False), "token offsets (vLLM gives them on its render endpoints only)"),
    "media_io_kwargs": ((None,), "multimodal input"),
    "mm_payload": ((None, "tensors"), "multimodal payloads (vLLM's render endpoints)"),
    "return_mm_kwargs": ((None, True), "multimodal payloads (vLLM's render endpoints)"),
    "ec_transfer_params": ((None,), "encoder-cache transfer (ec_transfer_params)"),
    "routed_experts_prompt_start": ((0,), "routed-expert data (no mixture-of-experts routing is recorded)"),
}


# repetition_detection's fields -> vLLM's flat fields of the same role (its spelling before the 0.32 object)
FLAT_NAMES = {"max_pattern_size": "max_repetition_pattern_size", "min_pattern_size": "min_repetition_pattern_size",
              "min_count": "repetition_min_count"}


class RepetitionRule(BaseModel):
    """vLLM's repetition_detection: end the output (finish_reason "repetition") once a pattern of
    min_pattern_size..max_pattern_size tokens has come min_count times in a row at its end."""

    model_config = ConfigDict(extra="forbid")
    max_pattern_size: int = Field(default=0, ge=0, le=MAX_PATTERN_SIZE, description="0: off")
    min_pattern_size: int = Field(default=0, ge=0, le=MAX_PATTERN_SIZE, description="0: 1")
    min_count: int = Field(default=0, ge=0, le=MAX_COUNT, description="at least 2 where detection is on")

    @property
    def on(self) -> bool:
        return self.max_pattern_size > 0

    def rule(self, spelled: dict[str, str]) -> RepetitionDetection | None:
        """The engine's rule, or None where max_pattern_size is 0 (vLLM's off). `spelled`: each field as the request
        named it, for the errors (sizes out of order, a count below 2)."""
        if not self.on:
            for field in ("min_pattern_size", "min_count"):
                if getattr(self, field):  # vLLM would ignore it: not in silence here
                    raise EngineInputError(f"{spelled[field]} needs {spelled['max_pattern_size']}, which turns "
                                           "detection on", spelled[field])
            return None
        try:
            return RepetitionDetection(self.max_pattern_size, self.min_pattern_size or 1, self.min_count)
        except EngineInputError as exc:
            field = exc.param.rsplit(".", 1)[-1]
            raise EngineInputError(str(exc).replace(exc.param, spelled[field]), spelled[field]) from None


class SamplingFields(BaseModel):
    """What both endpoints share: OpenAI's sampling fields and the vLLM extensions clients send to vLLM."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, description="choices; the server's max_n bounds it")
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, description="token id (as a string) -> bias in [-100, 100]")
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(default=None, description="accepted: the prefix cache is automatic")
    service_tier: Literal["auto", "default"] | None = None
    # vLLM's extensions
    top_k: int | None = Field(default=None, description="-1 or None: off")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False  # benchmarks need fixed output lengths
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256,
                                   description="prefix-cache blocks are shared only with the same salt")
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = Constraint
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = Constraint
    guided_decoding_backend: str | None = None  # one backend here, llguidance: the choice changes nothing
    guided_whitespace_pattern: str | None = Field(default=None, max_length=MAX_WHITESPACE_PATTERN_CHARS,
                                                  description="structured_outputs.whitespace_pattern, for any JSON one")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, description="keep the prompt's last k tokens")
    truncation_side: Literal["left", "right"] | None = Field(
        default=None, description="with truncate_prompt_tokens: 'left' (None) keeps the last k, 'right' the first k")
    stream_interval: int | None = Field(default=None, ge=1, le=1 << 20, description=(
        "tokens per streamed chunk after the first for this request, at least the server's stream_interval"))
    session_id: str | None = Field(default=None, max_length=256, description=(
        "accepted: a conversation's identity (vLLM's KV events carry it; the prefix cache is automatic here)"))
    return_token_ids: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                        description="each prompt token's logprob and rank, with this many alternatives")
    priority: int = Field(default=0, description="under the engine's priority policy, a lower value is served first")
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>": text cannot say every token
    thinking_token_budget: int | None = Field(default=None, ge=-1, lt=1 << 31, description=(
        "at most this many tokens in each thinking section (the app's reasoning_parser's markers), whose end is then "
        "forced; -1 or None: unlimited"))
    logprob_token_ids: list[int] | None = Field(default=None, max_length=MAX_LOGPROB_TOKEN_IDS, description=(
        "each output token's top logprobs are these ids' (and the chosen one's), in this order; needs logprobs, "
        "and takes the place of top_logprobs"))
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1,
                                                description="the only tokens the output may hold")
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS,
                                        description="words the output may not hold, token by token as vLLM bans them")
    request_id: str | None = Field(default=None, pattern=REQUEST_ID.pattern,
                                   description="the response's id, as an X-Request-Id header would set it")
    use_beam_search: bool = Field(default=False, description="the n best beams of a beam search of width n")
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0,
                                  description="beams rank by cumulative logprob / length ** length_penalty")
    repetition_detection: RepetitionRule | None = None
    # the same rule as vLLM spelled it before (each field the object's of the same role)
    max_repetition_pattern_size: int = Field(default=0, ge=0, le=MAX_PATTERN_SIZE)
    min_repetition_pattern_size: int = Field(default=0, ge=0, le=MAX_PATTERN_SIZE)
    repetition_min_count: int = Field(default=0, ge=0, le=MAX_COUNT)

    @model_validator(mode="before")
    @classmethod
    def _refuse_vllm_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_asked(data, UNSUPPORTED_VLLM_FIELDS)
        return data

    @model_validator(mode="after")
    def _prompt_scored_once(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM: not ignored in silence
            raise PydanticCustomError("stream", "stream_options needs stream: true", {"path": "stream_options"})
        if self.prompt_logprobs is not None and self.stream:
            raise refuse("prompt_logprobs", "prompt_logprobs in a stream (as vLLM: score the prompt without streaming)")
        if self.logprob_token_ids and self.num_logprobs is None:  # vLLM's rule
            raise PydanticCustomError("logprobs", "logprob_token_ids needs logprobs (true in a chat, a count in a "
                                      "completion)", {"path": "logprob_token_ids"})
        if self.prompt_logprobs is not None and self.scores_prompt_by_echo:
            raise refuse("prompt_logprobs", "prompt_logprobs beside echo with logprobs (each scores the prompt: "
                         "ask for one)")
        return self

    @property
    def scores_prompt_by_echo(self) -> bool:
        """Completions' echo with logprobs, which scores the prompt in OpenAI's format."""
        return False

    @model_validator(mode="after")
    def _one_repetition_spelling(self) -> "SamplingFields":
        flat = [name for name in FLAT_NAMES.values() if getattr(self, name)]
        if flat and self.repetition_detection is not None:
            raise refuse(flat[0], f"{flat[0]} beside repetition_detection (one spelling of the rule: vLLM's current "
                                  "is the object)")
        return self

    def repetition_rule(self) -> RepetitionDetection | None:
        """vLLM's repetition detection in either spelling, as the engine's rule."""
        if self.repetition_detection is not None:
            return self.repetition_detection.rule(PARAMS)  # the engine's names are the object's
        flat = RepetitionRule(**{field: getattr(self, name) for field, name in FLAT_NAMES.items()})
        return flat.rule(FLAT_NAMES)

    @property
    def detects_repetition(self) -> bool:
        return self.max_repetition_pattern_size > 0 or (self.repetition_detection is not None
                                                        and self.repetition_detection.on)

    @model_validator(mode="after")
    def _beam_search_alone(self) -> "SamplingFields":
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise refuse("length_penalty", "length_penalty without use_beam_search (it ranks a beam search's beams)")
            return self
        for field in self.beam_search_conflicts():
            raise refuse(field, f"{field} beside use_beam_search (beams rank by the model's own log-probabilities "
                                "and end at EOS or max_tokens)")
        return self

    def beam_search_conflicts(self) -> list[str]:
        """The fields set that a beam search cannot follow (vLLM's would ignore them)."""
        asks = {"temperature": "temperature" in self.model_fields_set and self.temperature != 0.0,
                "top_p": self.top_p != 1.0, "top_k": self.top_k not in (None, -1), "min_p": self.min_p != 0.0,
                "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
                "repetition_penalty": self.repetition_penalty != 1.0, "logit_bias": bool(self.logit_bias),
                "stop": bool(self.stop), "stop_token_ids": bool(self.stop_token_ids), "min_tokens": self.min_tokens > 0,
                "logprob_token_ids": bool(self.logprob_token_ids),  # before logprobs, which it needs: named first
                "logprobs": self.num_logprobs is not None, "prompt_logprobs": self.prompt_logprobs is not None,
                "allowed_token_ids": self.allowed_token_ids is not None, "bad_words": bool(self.bad_words),
                "repetition_detection": self.detects_repetition, "thinking_token_budget": self.thinking_budget is not None}
        return [field for field, asked in asks.items() if asked] + self.constraint_fields

    @model_validator(mode="after")
    def _one_constraint(self) -> "SamplingFields":
        given = [name for name in self.constraint_fields]
        if len(given) > 1:
            raise PydanticCustomError("constraint", "one output constraint per request, got {given}",
                                      {"given": " and ".join(given), "path": given[1]})
        return self

    @property
    def constraint_fields(self) -> list[str]:
        """The fields that constrain the output, as the request sets them (at most one may)."""
        fields = [field for field in GUIDED_FIELDS if getattr(self, field) is not None]
        if self.structured_outputs is not None:
            fields.append("structured_outputs")
        if self.response_format is not None and self.response_format.type != "text":
            fields.append("response_format")
        return fields

    def structured_output(self) -> StructuredOutput | None:
        """The output constraint the request sets, if any (forced tool calls are the chat endpoint's)."""
        spec = next((constraint(key, getattr(self, field), field) for field, key in GUIDED_FIELDS.items()
                     if getattr(self, field) is not None), None)
        if spec is None and self.structured_outputs is not None:
            spec = self.structured_outputs.structured_output()
        if spec is None and self.response_format is not None:
            spec = self.response_format.structured_output()
        return self._with_guided_whitespace(spec)

    def _with_guided_whitespace(self, spec: StructuredOutput | None) -> StructuredOutput | None:
        if self.guided_whitespace_pattern is None:
            return spec
        if spec is None or spec.whitespace_pattern is not None:
            raise EngineInputError("guided_whitespace_pattern needs one JSON constraint without a pattern of its own",
                                   "guided_whitespace_pattern")
        return with_whitespace(spec, self.guided_whitespace_pattern, "guided_whitespace_pattern")

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and not all(key.isascii() and key.isdigit() for key in value):  # "²" is a digit to Python
            raise PydanticCustomError("token_id", "keys must be token ids, written as strings of digits", {})
        return value

    @property
    def thinking_budget(self) -> int | None:
        """thinking_token_budget, None where unlimited (-1, as vLLM reads it)."""
        return None if self.thinking_token_budget in (None, -1) else self.thinking_token_budget

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token, or None when logprobs are not asked for."""
        return None


class CompletionRequest(SamplingFields):
    # one prompt (text or token ids) or a batch of them (texts or token lists), as OpenAI's completions take
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, description="16 when omitted, as OpenAI's and vLLM's completions")
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise refuse("best_of", "best_of other than n (choices are not ranked server-side)")
        if len(self.prompts) > MAX_PROMPTS:
            raise PydanticCustomError("prompt", "at most {limit} prompts in one request, got {count}",
                                      {"limit": MAX_PROMPTS, "count": len(self.prompts), "path": "prompt"})
        return self

    @property
    def scores_prompt_by_echo(self) -> bool:
        return self.echo and self.logprobs is not None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts in order (choice k * n + i is prompt k's choice i), or the one prompt."""
        batch = isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)
        return list(self.prompt) if batch else [self.prompt]

    @model_validator(mode="before")
    @classmethod
    def _refuse_suffix(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("suffix"):
            raise refuse("suffix", "this model has no fill-in-the-middle mode")
        if isinstance(data, dict) and data.get("add_special_tokens") is False:
            raise refuse("add_special_tokens", "add_special_tokens false (a text prompt starts as the tokenizer "
                         "starts it; token ids are sent as they are)")
        return data

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    arguments: str = "{}"


class ToolCallMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=64)
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        for j, part in enumerate(value if isinstance(value, list) else ()):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise PydanticCustomError("part", "part {j}: only text parts are supported, got {kind}",
                                          {"j": j, "kind": repr(kind)})  # a template has no !r
        return value

    @model_validator(mode="after")
    def _roles_carry_their_fields(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("role", "only assistant messages carry tool_calls", {})
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content", "content is required (it may be null only beside tool_calls)", {})
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("tool", "a tool message needs the tool_call_id it answers", {})
        return self

    def for_template(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments are enforced against `parameters` whenever a call is forced


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: dict[Literal["name"], str]


# OpenAI chat fields this server does not implement, each refused by name when set
UNSUPPORTED_CHAT_FIELDS = {
    "audio": "audio output", "modalities": "output modalities other than text", "prediction": "predicted outputs",
    "functions": "the deprecated functions field (use tools)", "function_call": "the deprecated function_call (use tool_choice)",
    "web_search_options": "web search", "verbosity": "verbosity", "store": "stored completions",
    # vLLM's chat extensions
    "echo": "echo in a chat (vLLM's: the last message prepended to the reply)",
    "add_special_tokens": "add_special_tokens in a chat (the chat template writes the special tokens)",
}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None  # tags for stored completions; nothing is stored
    # vLLM's chat extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = Field(default=None, max_length=MAX_DOCUMENTS, description=(
        "for a RAG chat template, which reads them (each e.g. a title and a text); another template refuses them"))
    include_reasoning: bool = True  # false: the reply's reasoning (the app's reasoning_parser) is left out
    reasoning_effort: ReasoningEffort | None = Field(
        default=None,
        description="for a chat template that reads it (gpt-oss's), as vLLM passes it; another refuses it")
    return_prompt_text: bool | None = None  # the prompt the template wrote, as `prompt_text` (a stream's first chunk)

    def chat_options(self) -> ChatOptions:
        """How the messages become the prompt; EngineInputError naming the field that cannot be."""
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {},
                           documents=self.documents, reasoning_effort=self.reasoning_effort)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for field, why in UNSUPPORTED_CHAT_FIELDS.items():
                value = data.get(field)
                if value not in (None, False) and not (field == "modalities" and value == ["text"]):
                    raise refuse(field, why)
        return data

    @model_validator(mode="after")
    def _tools_fit_together(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("logprobs", "top_logprobs needs logprobs: true", {"path": "top_logprobs"})
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise PydanticCustomError("tools", "tool_choice needs tools", {"path": "tool_choice"})
        if self.tools and sum(count_objects(t.function.parameters or {}) for t in self.tools) > MAX_SCHEMA_NODES:
            raise PydanticCustomError("tools", "the tools' parameter schemas may hold at most {limit} objects in all",
                                      {"limit": MAX_SCHEMA_NODES, "path": "tools"})
        name = self.forced_function
        if name is not None and name not in {t.function.name for t in self.tools}:
            raise PydanticCustomError("tools", "no tool is named '{name}'", {"path": "tool_choice", "name": name})
        if self.tools and self.constraint_fields and self.effective_tool_choice != "none":
            raise PydanticCustomError("tools", "{field} cannot constrain a reply that may call tools; "
                                      "set tool_choice to none", {"field": self.constraint_fields[0],
                                                                  "path": self.constraint_fields[0]})
        return self

    def beam_search_conflicts(self) -> list[str]:
        return super().beam_search_conflicts() + (["tools"] if self.effective_tool_choice != "none" else [])

    @property
    def effective_tool_choice(self) -> str:
        """none | auto | required | named, as OpenAI defaults it: auto when tools are given."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.get("name") if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a prompt's token ids, as a completion (`prompt`) or a chat completion (`messages`,
    with `tools` if offered, the generation prompt added) would count them in `usage.prompt_tokens`."""

    model_config = ConfigDict(extra="forbid")  # not an OpenAI route: a field this server does not know is refused
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {})

    @model_validator(mode="after")
    def _one_prompt(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("prompt", "give either prompt or messages", {"path": "prompt"})
        if self.tools and self.messages is None:
            raise PydanticCustomError("tools", "tools are offered in a chat: give messages", {"path": "tools"})
        return self

    def template_input(self) -> str | list[dict[str, Any]]:
        return self.prompt if self.messages is None else [m.for_template() for m in self.messages]


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`: the text of token ids."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
