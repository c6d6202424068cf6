"""Tool calls in the Hermes format that Qwen2.5, Hermes and many fine-tunes emit (vLLM's `hermes` parser; each part
takes `fmt="llama3_json"` for Llama 3's format, engine/llama3_tool_calls.py):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One format everywhere: the system prompt that describes the tools (for chat templates with no tool support of their
own), the grammar that forces a call (tool_choice required or a named function), and the parser that turns output
text back into calls. SmolLM2's own tuning wraps a JSON list in the same tags, which the parser also reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine import llama3_tool_calls
from engine.sampling_params import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT = {"type": "object"}


FORMATS = ("hermes", "llama3_json")  # vLLM's --tool-call-parser names


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def system_prompt(tools: list[dict], fmt: str = "hermes") -> str:
    """The tools and the call format, for a chat template that cannot render `tools` itself."""
    if fmt == "llama3_json":
        return llama3_tool_calls.system_prompt(tools)
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You may call one or more functions to assist with the user query. You are provided with function "
            f"signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)


def as_text(tool_calls: list[dict], fmt: str = "hermes") -> str:
    """An assistant turn's OpenAI `tool_calls`, written the way the model is asked to write them."""
    if fmt == "llama3_json":
        return llama3_tool_calls.as_text(tool_calls)
    blocks = []
    for call in tool_calls:
        function = call["function"]
        raw = function.get("arguments") or "{}"
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
            text = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past the parser's depth: kept as sent
            text = json.dumps({"name": function["name"], "arguments": raw if isinstance(raw, str) else "{}"},
                              ensure_ascii=False)
        blocks.append(f"{OPEN}\n{text}\n{CLOSE}")
    return "\n".join(blocks)


def grammar(tools: list[dict], only: str | None = None, parallel: bool = True, fmt: str = "hermes") -> str:
    """A Lark grammar (llguidance's dialect) whose every output is one call (or, with `parallel`, several) to
    `only` or to any of `tools`, with arguments valid against the function's JSON schema."""
    if fmt == "llama3_json":
        return llama3_tool_calls.grammar(tools, only, parallel)
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or ANY_OBJECT}}
             for f in functions]
    schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
    schema = {**schema, "x-guidance": JSON_OPTIONS}  # response_format's JSON layout: forced and free calls read the same
    repeat = ' ("\\n" block)*' if parallel and only is None else ""
    return (f"start: block{repeat}\n"
            f"block: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n"
            f"call: %json {json.dumps(schema)}\n")


def parse(text: str, fmt: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's output: the text before the first call is the content (None if blank). Output
    with no well-formed call is all content, with no calls."""
    if fmt == "llama3_json":
        content, calls = llama3_tool_calls.parse(text)
        return content, [ToolCall(name, arguments) for name, arguments in calls]
    calls = []
    for block in _blocks(text):
        try:
            payload = json.loads(block)
        except (json.JSONDecodeError, RecursionError):  # nesting past the parser's depth is no call either
            return text, []
        for item in payload if isinstance(payload, list) else [payload]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return text, []
            arguments = item.get("arguments", item.get("parameters", {}))
            calls.append(ToolCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    if not calls:
        return text, []
    content = text[: text.index(OPEN)].strip()
    return content or None, calls


def _blocks(text: str):
    """The stripped text between each opening tag and the next closing one. str.find, not a regex: a lazy group
    between `\\s*`s backtracks quadratically over a long run of whitespace with no closing tag, and the output is
    the model's, which a client can steer (logit_bias)."""
    start = 0
    while (opening := text.find(OPEN, start)) != -1:
        closing = text.find(CLOSE, opening + len(OPEN))
        if closing == -1:
            return
        yield text[opening + len(OPEN) : closing].strip()
        start = closing + len(CLOSE)


def safe_content_length(text: str, fmt: str = "hermes") -> int:
    """How much of streamed text is surely content: everything before a call's opening tag, or before a suffix that
    could still grow into one. The rest is held back until the output is complete."""
    if fmt == "llama3_json":
        return llama3_tool_calls.safe_content_length(text)
    if OPEN in text:
        return text.index(OPEN)
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
