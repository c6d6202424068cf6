"""OpenAI's Responses API (`POST /v1/responses`) as a front on chat completions, its request half: a request becomes
a ChatCompletionRequest, so every check and limit of the chat route holds, and a refusal names the field as the
Responses request spells it (responses_api_output.py turns the chat's result back). Nothing is stored: `store: true`,
`previous_response_id` and the other stateful fields are refused by name."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from serve_app.errors import OpenAIError, describe_validation_error
from serve_app.openai_protocol import (MAX_TOOLS, UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_VLLM_FIELDS, ChatCompletionRequest,
                                      ReasoningEffort, check_unicode, refuse, refuse_asked, refuse_tool_kinds)

# Responses fields this server does not implement: field -> (the values that ask for nothing, why refused)
UNSUPPORTED_FIELDS: dict[str, tuple[tuple, str]] = {
    "store": ((None, False), "stored responses (send store: false; nothing is kept)"),
    "previous_response_id": ((None,), "previous_response_id (nothing is stored: send the whole conversation as input)"),
    "conversation": ((None,), "conversations (nothing is stored)"),
    "background": ((None, False), "background responses"),
    "include": ((None, []), "include (no reasoning, search or logprob extras)"),
    "prompt": ((None,), "stored prompt templates"),
    "max_tool_calls": ((None,), "max_tool_calls"),
    "top_logprobs": ((None, 0), "top_logprobs in a response"),
    "truncation": ((None, "disabled"), "truncation auto (a conversation that does not fit is refused)"),
    "stream_options": ((None, {}, {"include_obfuscation": False}), "stream obfuscation"),
    # a beam search's beams are chat choices, and a response has one output
    "use_beam_search": ((None, False), "use_beam_search in a response (it has one output, not n beams)"),
    "length_penalty": ((None, 1, 1.0), "length_penalty in a response (a beam search's)"),
    # vLLM's Responses extensions
    "enable_response_messages": ((None, False), "enable_response_messages (the response's messages are not returned)"),
    "previous_input_messages": ((None,), "previous_input_messages (send the whole conversation as input)"),
}
# chat fields a response has its own spelling of, or no place for: refused by name rather than passed on
CHAT_ONLY_FIELDS = {
    "messages": "messages (a response takes input and instructions)",
    "max_tokens": "max_tokens (a response takes max_output_tokens)",
    "max_completion_tokens": "max_completion_tokens (a response takes max_output_tokens)",
    "response_format": "response_format (a response takes text.format)",
    "n": "n (a response has one output)",
    "logprobs": "logprobs in a response", "request_id": "request_id in a response",
    "return_token_ids": "return_token_ids in a response", "return_tokens_as_token_ids": "token ids in a response",
    "prompt_logprobs": "prompt_logprobs in a response",
    "return_prompt_text": "return_prompt_text in a response", "stream_interval": "stream_interval in a response",
    "logprob_token_ids": "logprob_token_ids in a response (it has no logprobs)",
}
# the names the chat route knows, served or refused: what a response passes on to it
CHAT_NAMES = {*ChatCompletionRequest.model_fields, *UNSUPPORTED_CHAT_FIELDS, *UNSUPPORTED_VLLM_FIELDS}
# chat's names for what a Responses request calls otherwise, for the refusals the chat checks write
FIELD_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort"}


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text"]
    text: str


class InputItem(BaseModel):
    """A message (`type` may be omitted), a function call the model made, or a function call's output."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputText] | None = None
    call_id: str | None = Field(default=None, max_length=128)
    name: str | None = Field(default=None, max_length=64)
    arguments: str | None = None
    output: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            kind = data.get("type", "message")
            if kind not in ("message", "function_call", "function_call_output"):
                raise PydanticCustomError("item", "item type {kind} is not supported (messages and function "
                                          "calls are)", {"kind": repr(kind)})  # a template has no !r
            for part in data.get("content") if isinstance(data.get("content"), list) else ():
                if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text"):
                    raise PydanticCustomError("part", "only text parts are supported, got {kind}",
                                              {"kind": repr(part.get("type"))})
        return data

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "InputItem":
        needs = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                 "function_call_output": ("call_id", "output")}[self.type]
        missing = [name for name in needs if getattr(self, name) is None]
        if missing:
            raise PydanticCustomError("item", "a {kind} item needs {missing}", {"kind": self.type,
                                                                                "missing": " and ".join(missing)})
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["medium"] | None = None  # the only one there is: the model has no other


class ReasoningOptions(BaseModel):
    """`effort` is chat's reasoning_effort (for a template that reads it, as vLLM passes it); the model's thinking
    comes back with the app's reasoning_parser, whole: there are no summaries of it."""

    model_config = ConfigDict(extra="forbid")
    effort: ReasoningEffort | None = None
    summary: None = None
    generate_summary: None = None  # the older name of summary


class ResponsesRequest(BaseModel):
    """OpenAI's fields; any other that the chat route knows (vLLM's sampling extensions: top_k, seed, stop,
    ignore_eos, ...) is passed on to it, with its checks and refusals; the rest are ignored, as on chat."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: list[InputItem] = Field(min_length=1, description="a string is one user message")
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    _defaults: dict[str, float] = PrivateAttr(default_factory=dict)  # see sampled_with
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextOptions = Field(default_factory=TextOptions)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    reasoning: ReasoningOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_unicode(data)
            refuse_asked(data, UNSUPPORTED_FIELDS)
            for field, why in CHAT_ONLY_FIELDS.items():
                if data.get(field) is not None:
                    raise refuse(field, why)
            if isinstance(data.get("input"), str):  # one user message: so a bad item's error names the item
                data = {**data, "input": [{"role": "user", "content": data["input"]}]}
            refuse_tool_kinds(data, ("function",), "function tools")
        return data

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this response is, validated as one; a refusal names the Responses field."""
        extensions = {name: value for name, value in (self.model_extra or {}).items()
                      if name in CHAT_NAMES and name not in UNSUPPORTED_FIELDS}
        sampling = {name: getattr(self, name) for name in ("temperature", "top_p") if name in self.model_fields_set}
        body = {**extensions, **sampling, "model": self.model, "messages": self._messages(), "stream": self.stream,
                "stream_options": {"include_usage": True} if self.stream else None,
                "parallel_tool_calls": self.parallel_tool_calls, "metadata": self.metadata, "user": self.user,
                "safety_identifier": self.safety_identifier, "prompt_cache_key": self.prompt_cache_key,
                "service_tier": self.service_tier, "max_completion_tokens": self.max_output_tokens,
                "reasoning_effort": self.reasoning.effort if self.reasoning is not None else None}
        if self.tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else {
                "type": "function", "function": {"name": self.tool_choice.get("name")}}
        form = self.text.format
        if form.type != "text":
            body["response_format"] = {"type": form.type} if form.type == "json_object" else {
                "type": "json_schema", "json_schema": {"name": form.name or "response", "schema": form.schema_ or {},
                                                       "strict": form.strict}}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # as the chat route would describe it; renamed() then spells it ours
            raise OpenAIError(400, *describe_validation_error(exc)) from None

    def _messages(self) -> list[dict]:
        """Chat messages: instructions first, as a system message; a run of function calls, one assistant turn."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in self.input:
            if item.type == "message":
                messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last and last["role"] == "assistant" and last.get("tool_calls") and not last.get("content"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return messages

    def sampled_with(self, defaults: dict[str, float]) -> None:
        """The model's sampling defaults (engine/sampling_defaults.py), which its unset temperature and top_p took."""
        self._defaults = defaults

    def echo(self) -> dict:
        """The request's settings, as a response repeats them: temperature and top_p as sampled."""
        shown = {name: getattr(self, name) if name in self.model_fields_set else
                 self._defaults.get(name, getattr(self, name)) for name in ("temperature", "top_p")}
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                **shown, "parallel_tool_calls": self.parallel_tool_calls,
                "tool_choice": self.tool_choice or "auto", "tools": [t.model_dump(by_alias=True) for t in self.tools or []],
                "text": self.text.model_dump(by_alias=True, exclude_none=True), "metadata": self.metadata or {},
                "store": False, "truncation": "disabled", "previous_response_id": None,
                "reasoning": {"effort": self.reasoning.effort if self.reasoning is not None else None, "summary": None},
                "user": self.user, "service_tier": self.service_tier or "default", "background": False}


def renamed(error: OpenAIError) -> OpenAIError:
    """A refusal of the chat request (or the engine's), naming the field as the Responses request spells it."""
    param, message = renamed_field(error.param, error.message)
    return OpenAIError(error.status, message, param, error.code, error.retry_after_s)


def renamed_field(param: str | None, message: str) -> tuple[str | None, str]:
    head, _, rest = (param or "").partition(".")
    if head not in FIELD_NAMES:
        return param, message
    ours = FIELD_NAMES[head] + (f".{rest}" if rest and head not in ("messages", "prompt") else "")
    for old in (param, head):
        if message.startswith(old):
            return ours, ours + message[len(old):]
    return ours, message
