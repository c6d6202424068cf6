"""The OpenAI requests we accept. An OpenAI field we do not implement is refused with a 400 that names it; fields
outside OpenAI's API (and vLLM's extensions we implement) are ignored."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.sampling_params import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, StructuredOutput

MAX_TOOLS = 128  # OpenAI's own bound
MAX_PROMPTS = 64  # a completion's batch of prompts; each prompt's n choices are engine requests of their own


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


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


class SamplingFields(BaseModel):
    """What both endpoints share: OpenAI's sampling fields and the vLLM extensions clients send to vLLM."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        path = find_unencodable(data)
        if path is not None:
            raise PydanticCustomError("unicode", "not valid Unicode (it holds a lone surrogate)", {"path": path})
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

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and not all(key.isascii() and key.isdigit() for key in value):  # "²" is a digit to Python
            raise PydanticCustomError("token_id", "keys must be token ids, written as strings of digits", {})
        return value

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
    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts in order (choice k * n + i is prompt k's choice i), or the one prompt."""
        batch = isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)
        return list(self.prompt) if batch else [self.prompt]

    @model_validator(mode="before")
    @classmethod
    def _refuse_suffix(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("suffix"):
            raise refuse("suffix", "this model has no fill-in-the-middle mode")
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
                raise PydanticCustomError("part", "part {j}: only text parts are supported, got {kind!r}",
                                          {"j": j, "kind": kind})
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
    "web_search_options": "web search", "reasoning_effort": "reasoning effort (the model does not reason)",
    "verbosity": "verbosity", "store": "stored completions",
}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None  # tags for stored completions; nothing is stored

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
        name = self.forced_function
        if name is not None and name not in {t.function.name for t in self.tools}:
            raise PydanticCustomError("tools", "no tool is named '{name}'", {"path": "tool_choice", "name": name})
        if self.tools and self.response_format is not None and self.response_format.type != "text" \
                and self.effective_tool_choice != "none":
            raise PydanticCustomError("tools", "response_format cannot constrain a reply that may call tools; "
                                      "set tool_choice to none", {"path": "response_format"})
        return self

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
