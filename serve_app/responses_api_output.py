"""OpenAI's Responses API, its output half: a whole chat completion becomes a response object, and the chat chunks
of a stream become the response's numbered, typed events."""
from __future__ import annotations

import itertools
import time
import uuid

from serve_app.responses import KEEP_ALIVE, retold_stream, sse_event
from serve_app.responses_api import ResponsesRequest, renamed_field

# a failed response's error codes are OpenAI's fixed few: the envelope's type -> the nearest of them
FAILED_CODES = {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}


def response_object(chat: dict, request: ResponsesRequest, response_id: str, model: str) -> dict:
    """A whole chat completion as a response: its reasoning (the app's reasoning parser) as a reasoning item, its
    text as a message item, each tool call a function_call item."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = [_reasoning_item(message["reasoning"], "completed")] if message.get("reasoning") else []
    output += [_message_item(message["content"], "completed")] if message.get("content") else []
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
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": chat.get("completion_tokens_details", {}).get("reasoning_tokens", 0)},
            "total_tokens": chat["total_tokens"]}


def _message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _reasoning_item(text: str, status: str) -> dict:
    """OpenAI's reasoning item as open-weight models' raw thinking fills it: a reasoning_text part, no summary."""
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": status, "summary": [],
            "content": [_reasoning_part(text)] if status == "completed" else []}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


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
        self.thinking: dict | None = None  # the open reasoning item
        self.thinking_text = ""
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
            if delta.get("reasoning"):
                events += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                events += self._close_reasoning()
                events += self._open_message()
                self.text += delta["content"]
                events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                         output_index=len(self.output) - 1, content_index=0,
                                         delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or ():
                events += self._close_reasoning() + self._close_message()
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[bytes]:
        events = self._close_reasoning() + self._close_message()
        response = self.response(self.finish_reason or "stop")
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=response)]

    def fail(self, error: dict) -> list[bytes]:
        """An error after the headers: OpenAI's error event, then the response, failed."""
        body = error["error"]
        param, message = renamed_field(body.get("param"), body["message"])
        response = {**self.response(self.finish_reason or "stop"), "status": "failed",
                    "error": {"code": FAILED_CODES.get(body.get("type"), "server_error"), "message": message}}
        return [self.event("error", code=body.get("code") or body.get("type"), message=message, param=param),
                self.event("response.failed", response=response)]

    def _reasoning(self, text: str) -> list[bytes]:
        """Reasoning text as it streams, in a reasoning item opened by its first delta."""
        events = []
        if self.thinking is None:
            self.thinking = _reasoning_item("", "in_progress")
            self.output.append(self.thinking)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=dict(self.thinking)))
        self.thinking_text += text
        return events + [self.event("response.reasoning_text.delta", item_id=self.thinking["id"],
                                    output_index=self.output.index(self.thinking), content_index=0, delta=text)]

    def _close_reasoning(self) -> list[bytes]:
        if self.thinking is None:
            return []
        index, item_id, text = self.output.index(self.thinking), self.thinking["id"], self.thinking_text
        self.thinking.update(status="completed", content=[_reasoning_part(text)])
        self.thinking = None
        return [self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text),
                self.event("response.output_item.done", output_index=index, item=self.output[index])]

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


def event_stream(chunks, request: ResponsesRequest, response_id: str, model: str, stream_error):
    """The SSE stream of a response from the chat chunks; `stream_error(exc, id)` gives an error's envelope."""
    return retold_stream(chunks, _Events(request, response_id, model), KEEP_ALIVE, stream_error, response_id)
