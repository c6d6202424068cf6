"""Tool calls in the JSON format Llama 3.1-3.3 are tuned for (vLLM's `llama3_json` parser): the reply is the call
itself, a JSON object with the function's name and its `parameters`, several joined by "; ", optionally after the
`<|python_tag|>` token:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

The same five parts as the Hermes format's in engine/tool_calls.py: a system prompt for templates that cannot
render tools (Meta's own wording for JSON calls), a call written back as text, the grammar that forces one, the
parser, and how much of a stream is surely not a call.
"""
from __future__ import annotations

import json

from engine.sampling_params import JSON_OPTIONS

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "
ANY_OBJECT = {"type": "object"}


def system_prompt(tools: list[dict]) -> str:
    listing = "\n\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("Given the following functions, please respond with a JSON for a function call with its proper arguments "
            "that best answers the given prompt.\n\nRespond in the format "
            '{"name": function name, "parameters": dictionary of argument name and its value}. Do not use '
            f"variables.\n\n{listing}")


def as_text(tool_calls: list[dict]) -> str:
    calls = []
    for call in tool_calls:
        function = call["function"]
        raw = function.get("arguments") or "{}"
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past the parser's depth: kept as sent
            arguments = raw
        calls.append(json.dumps({"name": function["name"], "parameters": arguments}, ensure_ascii=False))
    return SEPARATOR.join(calls)


def grammar(tools: list[dict], only: str | None = None, parallel: bool = True) -> str:
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": f["name"]}, "parameters": f.get("parameters") or ANY_OBJECT}}
             for f in functions]
    schema = {**({"anyOf": calls} if len(calls) > 1 else calls[0]), "x-guidance": JSON_OPTIONS}
    repeat = f" ({json.dumps(SEPARATOR)} call)*" if parallel and only is None else ""
    return f"start: call{repeat}\ncall: %json {json.dumps(schema)}\n"


def parse(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, JSON arguments)]): a reply that is one or more calls is calls alone (no content); any other
    reply is content."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            payload, end = decoder.raw_decode(body, at)
        except (json.JSONDecodeError, RecursionError):
            return text, []
        arguments = payload.get("parameters", payload.get("arguments")) if isinstance(payload, dict) else None
        if not isinstance(payload.get("name") if isinstance(payload, dict) else None, str) or not isinstance(arguments, dict):
            return text, []
        calls.append((payload["name"], json.dumps(arguments, ensure_ascii=False)))
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return None, calls


def safe_content_length(text: str) -> int:
    """A reply that starts (after blanks) with "{" or the python tag may be a call: all of it waits for the end."""
    head = text.lstrip()
    if not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
        return 0
    return len(text)
