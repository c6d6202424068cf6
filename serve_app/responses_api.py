"""OpenAI's Responses API (`POST /v1/responses`) as a front on chat completions: a request becomes a
ChatCompletionRequest (so every check and limit of the chat route holds), and the chat result becomes a response
object, or the chat chunks its typed stream events. Nothing is stored: `store: true`, `previous_response_id` and the
other stateful fields are refused by name."""
from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from serve_app.errors import OpenAIError
from serve_app.openai_protocol import (MAX_TOOLS, UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_VLLM_FIELDS, ChatCompletionRequest,
                                      find_unencodable, refuse)
from serve_app.responses import KEEP_ALIVE, sse_event

# Responses fields this server does not implement: field -> (the values that ask for nothing, why refused)
UNSUPPORTED_FIELDS: dict[str, tuple[tuple, str]] = {
    "store": ((None, False), "stored responses (send store: false; nothing is kept)"),
    "previous_response_id": ((None,), "previous_response_id (nothing is stored: send the whole conversation as input)"),
    "conversation": ((None,), "conversations (nothing is stored)"),
    "background": ((None, False), "background responses"),
    "include": ((None, []), "include (no reasoning, search or logprob extras)"),
    "reasoning": ((None,), "reasoning options (the model does not reason)"),
    "prompt": ((None,), "stored prompt templates"),
    "max_tool_calls": ((None,), "max_tool_calls"),
    "top_logprobs": ((None, 0), "top_logprobs in a response"),
    "truncation": ((None, "disabled"), "truncation auto (a conversation that does not fit is refused)"),
    "stream_options": ((None, {}, {"include_obfuscation": False}), "stream obfuscation"),
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
}
# the names the chat route knows, served or refused: what a response passes on to it
CHAT_NAMES = {*ChatCompletionRequest.model_fields, *UNSUPPORTED_CHAT_FIELDS, *UNSUPPORTED_VLLM_FIELDS}
# a failed response's error codes are OpenAI's fixed few: the envelope's type -> the nearest of them
FAILED_CODES = {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}
# chat's names for what a Responses request calls otherwise, for the refusals the chat checks write
FIELD_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "response_format": "text.format"}


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
                raise PydanticCustomError("item", "item type {kind!r} is not supported (messages and function "
                                          "calls are)", {"kind": kind})
            for part in data.get("content") if isinstance(data.get("content"), list) else ():
                if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text"):
                    raise PydanticCustomError("part", "only text parts are supported, got {kind!r}",
                                              {"kind": part.get("type")})
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


class ResponsesRequest(BaseModel):
    """OpenAI's fields; any other that the chat route knows (vLLM's sampling extensions: top_k, seed, stop,
    ignore_eos, ...) is passed on to it, with its checks and refusals; the rest are ignored, as on chat."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: list[InputItem] = Field(min_length=1, description="a string is one user message")
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
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

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            path = find_unencodable(data)
            if path is not None:
                raise PydanticCustomError("unicode", "not valid Unicode (it holds a lone surrogate)", {"path": path})
            for field, (nothing, why) in UNSUPPORTED_FIELDS.items():
                if field in data and data[field] not in nothing:
                    raise refuse(field, why)
            for field, why in CHAT_ONLY_FIELDS.items():
                if data.get(field) is not None:
                    raise refuse(field, why)
            if isinstance(data.get("input"), str):  # one user message: so a bad item's error names the item
                data = {**data, "input": [{"role": "user", "content": data["input"]}]}
            tools = data.get("tools")
            for i, tool in enumerate(tools if isinstance(tools, list) else ()):
                if isinstance(tool, dict) and tool.get("type") != "function":
                    raise refuse(f"tools.{i}", f"{tool.get('type')!r} tools (function tools are served)")
        return data

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this response is, validated as one; a refusal names the Responses field."""
        extensions = {name: value for name, value in (self.model_extra or {}).items()
                      if name in CHAT_NAMES and name not in UNSUPPORTED_FIELDS}
        body = {**extensions, "model": self.model, "messages": self._messages(), "temperature": self.temperature,
                "top_p": self.top_p, "stream": self.stream, "stream_options": {"include_usage": True} if self.stream else None,
                "parallel_tool_calls": self.parallel_tool_calls, "metadata": self.metadata, "user": self.user,
                "safety_identifier": self.safety_identifier, "prompt_cache_key": self.prompt_cache_key,
                "service_tier": self.service_tier, "max_completion_tokens": self.max_output_tokens}
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
        except ValidationError as exc:
            first = exc.errors()[0]
            path = (first.get("ctx") or {}).get("path") or ".".join(str(p) for p in first.get("loc", ()))
            raise OpenAIError(400, f"{path}: {first.get('msg')}", str(path)) from None

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

    def echo(self) -> dict:
        """The request's settings, as a response repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
                "tool_choice": self.tool_choice or "auto", "tools": [t.model_dump(by_alias=True) for t in self.tools or []],
                "text": self.text.model_dump(by_alias=True, exclude_none=True), "metadata": self.metadata or {},
                "store": False, "truncation": "disabled", "previous_response_id": None, "reasoning": None,
                "user": self.user, "service_tier": self.service_tier or "default", "background": False}


def renamed(error: OpenAIError) -> OpenAIError:
    """A refusal of the chat request (or the engine's), naming the field as the Responses request spells it."""
    param, message = _renamed_field(error.param, error.message)
    return OpenAIError(error.status, message, param, error.code, error.retry_after_s)


def _renamed_field(param: str | None, message: str) -> tuple[str | None, str]:
    head, _, rest = (param or "").partition(".")
    if head not in FIELD_NAMES:
        return param, message
    ours = FIELD_NAMES[head] + (f".{rest}" if rest and head not in ("messages", "prompt") else "")
    for old in (param, head):
        if message.startswith(old):
            return ours, ours + message[len(old):]
    return ours, message


def response_object(chat: dict, request: ResponsesRequest, response_id: str, model: str) -> dict:
    """A whole chat completion as a response: its text as a message item, each tool call a function_call item."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = [_message_item(message["content"], "completed")] if message.get("content") else []
    output += [_call_item(call, "completed") for call in message.get("tool_calls") or ()]
    return _response(response_id, model, request, chat["created"], choice["finish_reason"], output, chat["usage"])


def _response(response_id: str, model: str, request: ResponsesRequest, created: int, finish_reason: str | None,
              output: list[dict], chat_usage: dict | None) -> dict:
    incomplete = finish_reason == "length"
    status = "in_progress" if finish_reason is None else "incomplete" if incomplete else "completed"
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": _usage(chat_usage) if chat_usage else None, **request.echo()}


def _usage(chat: dict) -> dict:
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: dict, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


class _Events:
    """Chat chunks -> Responses stream events, numbered; one message item for the text, one item per tool call."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str):
        self.request, self.response_id, self.model = request, response_id, model
        self.numbers = itertools.count()
        self.created = int(time.time())
        self.output: list[dict] = []
        self.message: dict | None = None  # the open message item
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def event(self, kind: str, **fields) -> bytes:
        return sse_event(kind, {"type": kind, "sequence_number": next(self.numbers), **fields})

    def response(self, status_from: str | None) -> dict:
        return _response(self.response_id, self.model, self.request, self.created, status_from, self.output, self.usage)

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.response(None)),
                self.event("response.in_progress", response=self.response(None))]

    def chunk(self, chunk: dict) -> list[bytes]:
        events = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._open_message()
                self.text += delta["content"]
                events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                         output_index=len(self.output) - 1, content_index=0,
                                         delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or ():
                events += self._close_message()
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[bytes]:
        events = self._close_message()
        response = self.response(self.finish_reason or "stop")
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=response)]

    def fail(self, error: dict) -> list[bytes]:
        """An error after the headers: OpenAI's error event, then the response, failed."""
        body = error["error"]
        param, message = _renamed_field(body.get("param"), body["message"])
        response = {**self.response(self.finish_reason or "stop"), "status": "failed",
                    "error": {"code": FAILED_CODES.get(body.get("type"), "server_error"), "message": message}}
        return [self.event("error", code=body.get("code") or body.get("type"), message=message, param=param),
                self.event("response.failed", response=response)]

    def _open_message(self) -> list[bytes]:
        if self.message is not None:
            return []
        self.message = _message_item("", "in_progress")
        self.output.append(self.message)
        index = len(self.output) - 1
        return [self.event("response.output_item.added", output_index=index, item=dict(self.message, content=[])),
                self.event("response.content_part.added", item_id=self.message["id"], output_index=index,
                           content_index=0, part=_text_part(""))]

    def _close_message(self) -> list[bytes]:
        if self.message is None:
            return []
        index, item_id, text = self.output.index(self.message), self.message["id"], self.text
        self.message.update(status="completed", content=[_text_part(text)])
        self.message = None
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=_text_part(text)),
                self.event("response.output_item.done", output_index=index, item=self.output[index])]

    def _call(self, call: dict) -> list[bytes]:
        """A whole tool call (the chat stream sends each at the end of the reply, parsed): its item's events."""
        item = _call_item(call, "completed")
        self.output.append(item)
        index, arguments = len(self.output) - 1, item["arguments"]
        return [self.event("response.output_item.added", output_index=index,
                           item=dict(item, arguments="", status="in_progress")),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=arguments),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=arguments),
                self.event("response.output_item.done", output_index=index, item=item)]


async def event_stream(chunks, request: ResponsesRequest, response_id: str, model: str, stream_error):
    """The SSE stream of a response from the chat chunks; `stream_error(exc, id)` gives an error's envelope. The
    chunks are closed at once when the client goes, so the engine stops the request then."""
    events = _Events(request, response_id, model)
    for event in events.start():
        yield event
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk is None:
                    yield KEEP_ALIVE
                    continue
                for event in events.chunk(chunk):
                    yield event
        for event in events.finish():
            yield event
    except Exception as exc:
        for event in events.fail(stream_error(exc, response_id)):
            yield event

