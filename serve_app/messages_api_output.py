"""Anthropic's Messages API, its output half: a whole chat completion becomes a message, and the chat chunks of a
stream become the message's typed events (message_start, content blocks opened, filled and closed, message_delta,
message_stop)."""
from __future__ import annotations

import contextlib
import json
import uuid

from serve_app.errors import as_anthropic
from serve_app.responses import retold_stream, sse_event

# chat's finish reasons as Anthropic's stop reasons; a stop string matched is its stop_sequence
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
PING = sse_event("ping", {"type": "ping"})  # Anthropic's keep-alive


def message_object(chat: dict, message_id: str, model: str, warm_only: bool = False) -> dict:
    """A whole chat completion as a message: its reasoning (the app's reasoning parser) as a thinking block, its text
    as a text block, each tool call a tool_use block. `warm_only` (max_tokens 0): no content, only the prompt
    counted."""
    choice = chat["choices"][0]
    reply = choice["message"]
    content = [_thinking_block(reply["reasoning"])] if reply.get("reasoning") else []
    content += [_text_block(reply["content"])] if reply.get("content") else []
    content += [_tool_use_block(call) for call in reply.get("tool_calls") or ()]
    if warm_only:
        return {**_message(message_id, model, [], _nothing_generated(chat["usage"])), **_stop("length", None)}
    return {**_message(message_id, model, content, chat["usage"]),
            **_stop(choice["finish_reason"], choice.get("stop_reason"))}


def _nothing_generated(chat_usage: dict) -> dict:
    thinking = {"reasoning_tokens": 0} if "completion_tokens_details" in chat_usage else None
    return {**chat_usage, "completion_tokens": 0, **({"completion_tokens_details": thinking} if thinking else {})}


def _message(message_id: str, model: str, content: list[dict], chat_usage: dict) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": None, "stop_sequence": None, "usage": _usage(chat_usage)}


def _stop(finish_reason: str | None, stop_reason: int | str | None) -> dict:
    if finish_reason == "stop" and isinstance(stop_reason, str):  # a stop string, not a token id
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": STOP_REASONS.get(finish_reason or "stop", "end_turn"), "stop_sequence": None}


def _usage(chat: dict) -> dict:
    """Anthropic counts the prompt's cached tokens apart from its input tokens; shown where the chat would show them."""
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens")
    counts = {"input_tokens": chat["prompt_tokens"] - (cached or 0), "output_tokens": chat["completion_tokens"]}
    if "completion_tokens_details" in chat:  # where the app parses reasoning
        counts["output_tokens_details"] = {"thinking_tokens": chat["completion_tokens_details"]["reasoning_tokens"]}
    if cached is not None:
        counts |= {"cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
    return counts


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def _thinking_block(text: str) -> dict:
    """Open-weight models' raw thinking; its signature only lets a client send the block back as Anthropic's are."""
    return {"type": "thinking", "thinking": text, "signature": uuid.uuid4().hex}


def _tool_use_block(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1), "name": call["function"]["name"],
            "input": _tool_input(call["function"]["arguments"])}


def _tool_input(arguments: str) -> dict:
    """A call's arguments as an object; the text of any that are not one (a reply the call format did not hold)."""
    with contextlib.suppress(ValueError):
        value = json.loads(arguments)
        if isinstance(value, dict):
            return value
    return {"arguments": arguments}


class _Events:
    """Chat chunks -> Messages stream events; a block is opened by its first delta and closed by the next kind's."""

    def __init__(self, message_id: str, model: str, warm_only: bool):
        self.message_id, self.model, self.warm_only = message_id, model, warm_only
        self.started = False
        self.index = -1  # the open block's, or the last closed one's
        self.open: str | None = None  # the open block's type
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.usage: dict = {"prompt_tokens": 0, "completion_tokens": 0}

    def chunk(self, chunk: dict) -> list[bytes]:
        self.usage = chunk.get("usage") or self.usage
        events = self._start()
        for choice in [] if self.warm_only else chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning"]})
            if delta.get("content"):
                events += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                events += self._tool_use(_tool_use_block(call))
            if choice.get("finish_reason"):
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return events

    def start(self) -> list[bytes]:
        return []  # message_start waits for the first chunk, which carries the prompt's usage

    def finish(self) -> list[bytes]:
        delta = _stop("length", None) if self.warm_only else _stop(self.finish_reason, self.stop_reason)
        counts = _usage(_nothing_generated(self.usage) if self.warm_only else self.usage)
        return self._start() + self._close() + [
            sse_event("message_delta", {"type": "message_delta", "delta": delta, "usage": counts}),
            sse_event("message_stop", {"type": "message_stop"})]

    def fail(self, error: dict) -> list[bytes]:
        """An error after the headers: Anthropic's error event, which ends the stream."""
        return [sse_event("error", as_anthropic(error))]

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        message = _message(self.message_id, self.model, [], self.usage)
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def _delta(self, kind: str, delta: dict) -> list[bytes]:
        events = [] if self.open == kind else self._close() + self._open({"type": kind, kind: ""} | (
            {"signature": ""} if kind == "thinking" else {}))
        return events + [self._event("content_block_delta", delta=delta)]

    def _open(self, block: dict) -> list[bytes]:
        self.index += 1
        self.open = block["type"]
        return [self._event("content_block_start", content_block=block)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        signed = self.open == "thinking"  # a thinking block ends with its signature
        events = [self._event("content_block_delta", delta={"type": "signature_delta", "signature": uuid.uuid4().hex})
                  ] if signed else []
        self.open = None
        return events + [self._event("content_block_stop")]

    def _tool_use(self, block: dict) -> list[bytes]:
        """A whole tool call (the chat stream sends each at the end of the reply, parsed): its block's events."""
        events = self._close() + self._open(block | {"input": {}})
        events.append(self._event("content_block_delta", delta={"type": "input_json_delta",
                                                                "partial_json": json.dumps(block["input"])}))
        return events + self._close()

    def _event(self, kind: str, **fields) -> bytes:
        return sse_event(kind, {"type": kind, "index": self.index, **fields})


def event_stream(chunks, message_id: str, model: str, stream_error, warm_only: bool = False):
    """The SSE stream of a message from the chat chunks; `stream_error(exc, id)` gives an error's envelope."""
    return retold_stream(chunks, _Events(message_id, model, warm_only), PING, stream_error, message_id)
