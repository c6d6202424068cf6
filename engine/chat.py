"""Chat messages to prompt text through the model's chat template.

Content may be a string or a list of text parts (joined with newlines, as vLLM does). Assistant turns may carry
`tool_calls` with no content, and `tool` turns answer them. Templates that know tools get them natively; for the
others (SmolLM2's among them) the tools go into the system prompt and calls and results are written in the Hermes
format of engine/tool_calls.py (or Llama 3's JSON calls, with ChatOptions.tool_format).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from engine import tool_calls
from engine.errors import EngineInputError

Messages = list[dict[str, Any]]
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}
MAX_TEMPLATE_KWARGS = 32
TEMPLATE_KWARG = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# Names the renderer sets itself (apply_chat_template's arguments, and the special tokens it passes to the template):
# a client's kwarg may not replace them
RESERVED_TEMPLATE_KWARGS = {
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "raise_exception", "strftime_now",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
}


@dataclass(frozen=True)
class ChatOptions:
    """How messages become a prompt (vLLM's chat fields): end with the assistant's turn opened (the default), or
    leave the last message open for the model to continue ("prefill" part of the reply), and extra variables for
    the model's template (e.g. Qwen3's `enable_thinking`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_format: str = "hermes"  # how tools and calls are written for a template that cannot render them
    template: str | None = None  # the offline caller's own template (vLLM's LLM.chat chat_template); None: the model's
    documents: list[dict[str, str]] | None = None  # vLLM's: what a RAG template (Command R's, Granite's) cites
    reasoning_effort: str | None = None  # OpenAI's, for a template that reads it (gpt-oss's), as vLLM passes it

    def __post_init__(self) -> None:
        if self.tool_format not in tool_calls.FORMATS:
            raise EngineInputError(f"tool_format must be one of {', '.join(tool_calls.FORMATS)}", "tool_format")
        if self.add_generation_prompt and self.continue_final_message:
            raise EngineInputError("continue_final_message: cannot be set with add_generation_prompt (set that to "
                                   "false to continue the last message)", "continue_final_message")
        kwargs = self.template_kwargs
        if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise EngineInputError(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} names", "chat_template_kwargs")
        for name in kwargs:
            if not (isinstance(name, str) and TEMPLATE_KWARG.match(name)) or name in RESERVED_TEMPLATE_KWARGS:
                raise EngineInputError(f"chat_template_kwargs: {name!r} is not a name a request may set (identifiers "
                                       "only; the template's own arguments and special tokens are set by the "
                                       "server)", "chat_template_kwargs")


DEFAULT_OPTIONS = ChatOptions()


def normalize(messages: Messages) -> Messages:
    """Messages with string content, checked; EngineInputError naming the first bad field."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise EngineInputError(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise EngineInputError(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}", "messages")
        calls = message.get("tool_calls") or None
        if calls is not None and role != "assistant":
            raise EngineInputError(f"messages[{i}].tool_calls: only assistant messages carry tool calls", "messages")
        content = _content_text(message.get("content"), i, may_be_empty=calls is not None)
        out.append({**message, "content": content, **({"tool_calls": calls} if calls else {})})
    return out


def _content_text(content: Any, index: int, may_be_empty: bool) -> str:
    if content is None and may_be_empty:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise EngineInputError(f"messages[{index}].content[{j}]: only text parts are supported, got {kind!r}",
                                       "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise EngineInputError(f"messages[{index}].content must be a string or a list of text parts", "messages")


def render(tokenizer, messages: Messages, tools: list[dict] | None = None, options: ChatOptions = DEFAULT_OPTIONS) -> str:
    """Prompt text for normalized messages, ending where the assistant's answer begins (or, continuing, inside the
    last message)."""
    return _apply(tokenizer, messages, tools, options, tokenize=False)


def encode(tokenizer, messages: Messages, tools: list[dict] | None = None, options: ChatOptions = DEFAULT_OPTIONS,
           sanitize: bool = True) -> list[int]:
    """The prompt's token ids. With `sanitize`, a control token (a special token, or an added one the template writes,
    such as `<|im_start|>`) inside the messages, tools or documents is encoded as the text it spells, so a client's
    text cannot open a turn of another role (transformers' sanitize_control_tokens); without, as vLLM encodes it."""
    if not sanitize:
        return tokenizer.encode(render(tokenizer, messages, tools, options), add_special_tokens=False)
    return list(_apply(tokenizer, messages, tools, options, tokenize=True, return_dict=False,
                       sanitize_control_tokens=True))


def _apply(tokenizer, messages: Messages, tools: list[dict] | None, options: ChatOptions, **how):
    template = options.template or tokenizer.chat_template or ""
    native_tools = "tools" in template
    if options.documents is not None and "documents" not in template:
        raise EngineInputError("documents: the chat template does not read documents (a RAG template does, such as "
                               "Command R's or Granite's)", "documents")
    kwargs = options.template_kwargs
    if options.reasoning_effort is not None:
        if "reasoning_effort" not in template:
            raise EngineInputError("reasoning_effort: the chat template does not read it (the model thinks as its "
                                   "template says; gpt-oss's reads it)", "reasoning_effort")
        kwargs = {**kwargs, "reasoning_effort": options.reasoning_effort}  # over chat_template_kwargs' own
    if "developer" not in template:  # OpenAI's newer name for the system role
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if not ("tool_calls" in template and native_tools):
        messages = [_as_plain_turn(m, options.tool_format) for m in messages]
    if tools and not native_tools:
        messages = _with_tools_in_system_prompt(messages, tools, options.tool_format)
    try:
        return tokenizer.apply_chat_template(messages, tools=tools if native_tools else None, **how,
                                             documents=options.documents, chat_template=options.template,
                                             add_generation_prompt=options.add_generation_prompt,
                                             continue_final_message=options.continue_final_message,
                                             **kwargs)
    except (ValueError, TemplateError) as exc:  # transformers' refusals, and the template's own raise_exception
        raise EngineInputError(f"messages: the chat template cannot render them so: {exc}", "messages") from None


def _as_plain_turn(message: dict, tool_format: str) -> dict:
    """A tool call or result as text, for templates that only render role and content."""
    if message.get("tool_calls"):
        text = tool_calls.as_text(message["tool_calls"], tool_format)
        return {"role": "assistant", "content": f"{message['content']}\n{text}" if message["content"] else text}
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    return {key: message[key] for key in ("role", "content", "name") if message.get(key) is not None}


def _with_tools_in_system_prompt(messages: Messages, tools: list[dict], tool_format: str) -> Messages:
    prompt = tool_calls.system_prompt(tools, tool_format)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
