"""Anthropic's Messages API (`POST /v1/messages` and `/v1/messages/count_tokens`, as vLLM serves them for Anthropic's
clients), its request half: a request becomes a ChatCompletionRequest, so every check and limit of the chat route
holds, and a refusal names the field as the Messages request spells it (messages_api_output.py turns the chat's
result back). As Anthropic's API does, a field it does not know is refused; the ones it knows and this server does
not implement are refused by name."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from serve_app.errors import OpenAIError, describe_validation_error
from serve_app.openai_protocol import MAX_TOOLS, ChatCompletionRequest, check_unicode, refuse_asked, refuse_tool_kinds

# Anthropic's fields that ask for what this server does not do: field -> (the values that ask for nothing, why)
UNSUPPORTED_FIELDS: dict[str, tuple[tuple, str]] = {
    "container": ((None,), "containers (no code execution tool runs here)"),
    "context_management": ((None,), "context management (send the conversation as it should be read)"),
    "mcp_servers": ((None, []), "MCP servers (tools are called by the client)"),
    "diagnostics": ((None,), "diagnostics (a cache miss has no reason recorded)"),
    "inference_geo": ((None,), "inference_geo (the request runs where this server runs)"),
    "speed": ((None, "standard"), "speed fast (one speed is served)"),
    "user_profile_id": ((None,), "user_profile_id (this server has no Anthropic profiles)"),
    "workspace_id": ((None,), "workspace_id (this server has no Anthropic workspaces)"),
}
ROLE_OF_BLOCK = {"tool_use": "assistant", "tool_result": "user", "thinking": "assistant",
                 "redacted_thinking": "assistant"}
BLOCK_TYPES = ("text", *ROLE_OF_BLOCK)
# Claude Code (2.1.154 on) sends context and messages under roles of its own; vLLM reads them as the user's, as here
CLIENT_USER_ROLES = ("ctx", "msg")
# Claude Code's first system block: a per-request billing hash for Anthropic, not an instruction; left out, as vLLM
# leaves it out, or every request's prompt would differ from its first tokens and miss the prefix cache
BILLING_HEADER = "x-anthropic-billing-header"


class CacheControl(BaseModel):
    """Accepted on any block: the prefix cache keeps every prompt's blocks without being asked."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Block(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cache_control: CacheControl | None = None


class TextBlock(Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None  # where an earlier reply's text came from: the text is what is read


class DirectCaller(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["direct"]  # the client called the tool: a server tool's calls are not served


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=64)
    input: dict[str, Any]
    caller: DirectCaller | None = None
    toolset_name: None = None  # toolsets are server tools


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=128)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    toolset_name: None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)
        return f"Error: {text}" if self.is_error else text  # a chat's tool message has no error flag


class ThinkingBlock(BaseModel):
    """An earlier turn's thinking, sent back: left out of the prompt, as Anthropic's API leaves it out."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                         Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") in CLIENT_USER_ROLES:
            data = {**data, "role": "user"}
        blocks = data.get("content") if isinstance(data, dict) else None
        for j, block in enumerate(blocks if isinstance(blocks, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise PydanticCustomError("block", "block {j}: {kind} blocks are not supported (text, tool_use, "
                                          "tool_result and thinking are)", {"j": j, "kind": repr(kind)})
        return data

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> "Message":
        """As Anthropic's API: the model's blocks in assistant turns, tool results in user turns, text anywhere."""
        for j, block in enumerate(self.content if isinstance(self.content, list) else ()):
            if block.type != "text" and self.role != ROLE_OF_BLOCK[block.type]:
                raise PydanticCustomError("role", "block {j}: {kind} blocks belong in {role} turns",
                                          {"j": j, "kind": block.type, "role": ROLE_OF_BLOCK[block.type]})
        return self


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    cache_control: CacheControl | None = None
    eager_input_streaming: bool | None = None  # accepted: a call streams whole once parsed, either way
    defer_loading: Literal[False] = False  # tool search is a server tool
    allowed_callers: list[Literal["direct"]] | None = None
    input_examples: list[dict[str, Any]] | None = Field(default=None, max_length=0)

    def chat_tool(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.input_schema,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named_when_a_tool(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("name", "name is given with type tool, and only then", {})
        return self

    def chat_choice(self) -> str | dict:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"any": "required"}.get(self.type, self.type)


class Thinking(BaseModel):
    """enabled: at most budget_tokens in each thinking section (vLLM's thinking_token_budget, with the app's reasoning
    parser's markers); disabled: none (a budget of 0, where the app parses reasoning); adaptive: as the model will.
    display omitted leaves the thinking out of the reply; summarized shows it as the model wrote it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0, lt=1 << 31)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> "Thinking":
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise PydanticCustomError("budget", "budget_tokens is given with type enabled, and only then", {})
        return self


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None
    # a chat template that reads OpenAI's reasoning_effort (gpt-oss's) gets it, as vLLM passes it; high, Anthropic's
    # default, asks nothing of one that does not, and low or medium is refused there
    effort: Literal["low", "medium", "high"] | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = Field(default=None, max_length=256)


class Conversation(BaseModel):
    """What a Messages request and a token count share: the conversation and the tools it may call."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None  # accepted: the prefix cache keeps every prompt's blocks anyway
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as on its chat route
    _origins: list[int | None] = PrivateAttr(default_factory=list)  # each chat message's index among `messages`

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_unicode(data)
            refuse_asked(data, UNSUPPORTED_FIELDS)
            refuse_tool_kinds(data, (None, "custom"), "the client's own tools")
        return data

    def chat_body(self, parses_reasoning: bool) -> dict:
        turns = _combined_turns(self.messages)
        body = {"model": self.model, "messages": self._chat_messages(turns),
                "chat_template_kwargs": self.chat_template_kwargs}
        if self.tools:
            body["tools"] = [tool.chat_tool() for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.chat_choice()
            body["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if _prefill(turns[-1][1]):  # the reply continues it, as Anthropic's does
            body |= {"continue_final_message": True, "add_generation_prompt": False}
        budget = self.thinking_budget(parses_reasoning)
        if budget is not None:
            body["thinking_token_budget"] = budget
        if self.thinking is not None and self.thinking.display == "omitted":
            body["include_reasoning"] = False
        return body

    def thinking_budget(self, parses_reasoning: bool) -> int | None:
        if self.thinking is None or self.thinking.type == "adaptive":
            return None
        if self.thinking.type == "disabled":  # nothing to hold back where the app knows of no thinking
            return 0 if parses_reasoning else None
        return self.thinking.budget_tokens

    def chat_request(self, parses_reasoning: bool) -> ChatCompletionRequest:
        """The chat completion this request is, validated as one; a refusal names the Messages field."""
        try:
            return ChatCompletionRequest.model_validate(self.chat_body(parses_reasoning))
        except ValidationError as exc:  # as the chat route would describe it; renamed() then spells it ours
            raise self.renamed(OpenAIError(400, *describe_validation_error(exc))) from None

    def _chat_messages(self, turns: list[tuple[int, Message]]) -> list[dict]:
        """The system prompt first; consecutive turns of one role as one turn, as Anthropic's API combines them; a
        user turn's tool results as tool messages before its text; an assistant turn's tool_use blocks as its tool
        calls. Earlier thinking is left out, as Anthropic leaves it out."""
        system = self.system if isinstance(self.system, str) else "\n".join(
            b.text for b in self.system or () if not b.text.startswith(BILLING_HEADER))
        messages, self._origins = ([{"role": "system", "content": system}], [None]) if system else ([], [])
        for k, message in turns:
            for chat in _chat_turn(message):
                messages.append(chat)
                self._origins.append(k)
        return messages

    def renamed(self, error: OpenAIError) -> OpenAIError:
        """A refusal of the chat request (or the engine's), naming the field as the Messages request spells it."""
        param, message = self._renamed_field(error.param, error.message)
        return OpenAIError(error.status, message, param, error.code, error.retry_after_s)

    def _renamed_field(self, param: str | None, message: str) -> tuple[str | None, str]:
        head, _, rest = (param or "").partition(".")
        index, _, field = rest.partition(".")
        if head == "messages" and index.isdigit() and int(index) < len(self._origins):
            origin = self._origins[int(index)]  # a chat message's fields are not a Messages turn's: the turn is named
            ours = "system" if origin is None else f"messages.{origin}"
        elif head == "tools" and field:
            ours = f"tools.{index}." + field.removeprefix("function.").replace("parameters", "input_schema", 1)
        else:
            ours = CHAT_FIELD_NAMES.get(head, head) + (f".{rest}" if rest else "")
        if not param or ours == param:
            return param, message
        return ours, (ours + message[len(param):] if message.startswith(param) else message)


# chat's names for what a Messages request calls otherwise, for the refusals the chat checks write
CHAT_FIELD_NAMES = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "stop": "stop_sequences",
                    "response_format": "output_config.format", "thinking_token_budget": "thinking.budget_tokens",
                    "user": "metadata.user_id", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
                    "reasoning_effort": "output_config.effort"}


def _combined_turns(messages: list[Message]) -> list[tuple[int, Message]]:
    """Consecutive turns of one role as one turn of all their blocks, each with the index of its first turn."""
    turns: list[tuple[int, Message]] = []
    for k, message in enumerate(messages):
        if turns and turns[-1][1].role == message.role:
            first, earlier = turns[-1]
            turns[-1] = (first, earlier.model_copy(update={"content": _blocks(earlier) + _blocks(message)}))
        else:
            turns.append((k, message))
    return turns


def _prefill(last: Message) -> bool:
    """A last assistant turn of text: the start of the reply (a turn with tool calls is a whole one)."""
    return last.role == "assistant" and not any(isinstance(b, ToolUseBlock) for b in _blocks(last))


def _blocks(message: Message) -> list:
    return [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content


def _chat_turn(message: Message) -> list[dict]:
    """One Messages turn as chat messages; its text blocks joined by newlines, as vLLM and the chat route join a
    message's text parts."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in message.content if isinstance(b, ToolResultBlock)]
    text = "\n".join(b.text for b in message.content if isinstance(b, TextBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if isinstance(b, ToolUseBlock)]
    if calls:  # an assistant's (Message checks each block's role)
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    if text or not results:  # a turn of tool results alone is just those
        return results + [{"role": message.role, "content": text}]
    return results


class MessagesRequest(Conversation):
    """Anthropic's `POST /v1/messages`."""

    max_tokens: int = Field(ge=0, description="0: the prompt is cached (one token is computed), and nothing returned")
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling of output_config.format

    def chat_body(self, parses_reasoning: bool) -> dict:
        body = super().chat_body(parses_reasoning) | {
            "max_completion_tokens": max(self.max_tokens, 1), "stop": self.stop_sequences, "stream": self.stream,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True} if self.stream else None,
            "user": self.metadata.user_id if self.metadata else None}
        body |= {name: getattr(self, name) for name in ("temperature", "top_p", "top_k")
                 if getattr(self, name) is not None}
        effort = self.output_config.effort if self.output_config else None
        if effort == "high":
            body["chat_template_kwargs"] = {"reasoning_effort": effort, **(self.chat_template_kwargs or {})}
        elif effort is not None:
            body["reasoning_effort"] = effort
        form = self.output_format or (self.output_config.format if self.output_config else None)
        if form is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": form.schema_}}
        return body

    @model_validator(mode="after")
    def _one_output_format(self) -> "MessagesRequest":
        if self.output_format is not None and self.output_config is not None and self.output_config.format is not None:
            raise PydanticCustomError("format", "give output_config.format or output_format, not both",
                                      {"path": "output_format"})
        return self


class CountTokensRequest(Conversation):
    """Anthropic's `POST /v1/messages/count_tokens`: the prompt's tokens, as a Messages request would count them."""
