"""The OpenAI response shapes we produce: whole completions, stream chunks, usage, logprobs and tool calls."""
from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from starlette.responses import JSONResponse

from engine import tool_calls
from serve_app.protocol import TokenLogprob
from serve_app.reasoning import ReasoningFormat, ReasoningSplitter, split


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage; `prompt_tokens_details` only where the cached count may be shown (None: not),
    `completion_tokens_details` where the app parses reasoning."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    def one(token: str, logprob: float, raw: list[int]) -> dict:
        return {"token": token, "logprob": logprob, "bytes": raw}

    return {"content": [{**one(e.token, e.logprob, e.bytes), "top_logprobs": [one(*t) for t in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict:
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token: logprob for token, logprob, _ in e.top} if e.logprob is not None else None
                             for e in entries],
            "text_offset": offsets}


def tool_call_list(calls: list[tool_calls.ToolCall]) -> list[dict]:
    return [{"index": i, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


@dataclass
class Choice:
    """One choice as it accumulates; `to_json` gives it as the non-streamed response has it."""

    index: int
    chat: bool
    parse_tool_calls: bool = False
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prefix: str = ""  # completions' echo
    prefix_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: the prompt's
    token_ids: list[int] | None = None  # return_token_ids: the output's ids ([] until they come; None: not asked)
    prompt_token_ids: list[int] | None = None  # return_token_ids: completions give each choice its prompt's
    prompt_scores: list[TokenLogprob] | None = None  # vLLM's prompt_logprobs: completions give each choice them
    reasoning: ReasoningFormat | None = None  # the app's reasoning parser: chat replies' thinking apart
    show_reasoning: bool = True  # include_reasoning
    reasoning_tokens: int = 0
    tool_format: str = "hermes"  # the app's tool-call parser
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended the choice

    def add(self, text: str, completion_tokens: int, finish_reason: str | None,
            logprobs: list[TokenLogprob] | None, token_ids: list[int] | None = None,
            reasoning_tokens: int | None = None, stop_reason: int | str | None = None) -> None:
        self.text += text
        self.reasoning_tokens = reasoning_tokens if reasoning_tokens is not None else self.reasoning_tokens
        self.completion_tokens, self.finish_reason, self.stop_reason = completion_tokens, finish_reason, stop_reason
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        if token_ids is not None:
            self.token_ids = (self.token_ids or []) + token_ids

    def to_json(self) -> dict:
        if not self.chat:
            text = self.prefix + self.text
            logprobs = None
            if self.logprobs is not None:
                logprobs = completion_logprobs((self.prefix_logprobs or []) + self.logprobs,
                                               0 if self.prefix_logprobs else len(self.prefix))
            choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason,
                      "stop_reason": self.stop_reason}
            if self.prompt_scores is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_scores)
            return self._with_ids(choice, self.prompt_token_ids)
        thinking, answer = split(self.text, self.reasoning) if self.reasoning is not None else (None, self.text)
        content, calls = tool_calls.parse(answer or "", self.tool_format) if self.parse_tool_calls else (answer, [])
        message = {"role": "assistant", "content": content if content or self.reasoning is None else None}
        if self.reasoning is not None and self.show_reasoning:
            message |= reasoning_fields(thinking)
        finish_reason = self.finish_reason
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_call_list(calls)]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        logprobs = chat_logprobs(self.logprobs) if self.logprobs is not None else None
        return self._with_ids({"index": self.index, "message": message, "logprobs": logprobs,
                               "finish_reason": finish_reason, "stop_reason": self.stop_reason})

    def _with_ids(self, choice: dict, prompt_token_ids: list[int] | None = None) -> dict:
        """vLLM's `token_ids` (and, for completions, `prompt_token_ids`) on a choice, when asked for."""
        if self.token_ids is not None:
            choice["token_ids"] = self.token_ids
            if prompt_token_ids is not None:
                choice["prompt_token_ids"] = prompt_token_ids
        return choice


def reasoning_fields(text: str | None) -> dict:
    """A message's or delta's reasoning, under vLLM's name and the one DeepSeek's API and older vLLMs use."""
    return {"reasoning": text, "reasoning_content": text}


def vllm_prompt_logprobs(scores: list[TokenLogprob]) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first token, which nothing predicts; then, by token id, the prompt's
    token and the most likely ones, each with its logprob, its rank (1: the model's first choice) and its text."""
    positions: list[dict | None] = [None]
    for score in scores[1:]:
        position = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": text}
                    for rank, (token, (text, logprob, _)) in enumerate(zip(score.top_ids, score.top), start=1)}
        position[str(score.token_id)] = {"logprob": score.logprob, "rank": score.rank, "decoded_token": score.token}
        positions.append(position)
    return positions


def completion_body(request_id: str, model: str, choices: list[Choice], chat: bool, usage_: dict,
                    created: int | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": created or int(time.time()), "model": model, "choices": [c.to_json() for c in choices],
            "usage": usage_}


@dataclass
class StreamedChoice:
    """One choice of a stream: turns deltas into chunk choices. With tools, text that may be a tool call is held
    back until the choice ends, then sent as tool_calls deltas (or as content, if it was none)."""

    index: int
    chat: bool
    parse_tool_calls: bool = False
    prefix: str = ""  # completions' echo: sent with the first chunk
    started: bool = False
    text: str = ""
    sent: int = 0
    text_offset: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_token_ids: list[int] | None = None  # return_token_ids: ids not yet sent ([]: asked, None: not)
    prompt_token_ids: list[int] | None = None  # return_token_ids, completions: sent with the choice's first chunk
    reasoning: ReasoningSplitter | None = None  # the app's reasoning parser: thinking streams apart from the answer
    show_reasoning: bool = True  # include_reasoning
    tool_format: str = "hermes"  # the app's tool-call parser

    def score_prompt(self, entries: list[TokenLogprob]) -> None:
        """Echo with logprobs: the prompt's scores lead this choice's first chunk."""
        if not self.started:
            self.pending_logprobs = entries + self.pending_logprobs

    def chunks(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None,
               token_ids: list[int] | None = None, stop_reason: int | str | None = None) -> list[dict]:
        """The chunk choices this delta makes (none while held back, unless it starts or ends the choice); the last
        names vLLM's stop_reason beside the finish_reason."""
        self.pending_logprobs += logprobs or []
        if token_ids is not None and self.pending_token_ids is not None:
            self.pending_token_ids += token_ids
        out = []
        if self.reasoning is not None:
            thinking, text = self.reasoning.feed(text)
            if finish_reason is not None:
                more_thinking, more_text = self.reasoning.finish()
                thinking, text = thinking + more_thinking, text + more_text
            if thinking and self.show_reasoning:
                out.append(self._choice(thinking, None, logprobs=logprobs is not None, field="reasoning"))
        self.text += text
        visible = tool_calls.safe_content_length(self.text, self.tool_format) if self.parse_tool_calls else len(self.text)
        if finish_reason is not None:
            final = self._final(finish_reason)
            final[-1]["stop_reason"] = stop_reason
            return out + final
        if visible > self.sent or not (self.started or out):
            new, self.sent = self.text[self.sent:visible], max(self.sent, visible)
            out.append(self._choice(new, None, logprobs=logprobs is not None))
        return out

    def _final(self, finish_reason: str) -> list[dict]:
        held = self.text[self.sent:]
        self.sent = len(self.text)
        content, calls = tool_calls.parse(held, self.tool_format) if self.parse_tool_calls else (held, [])
        if not calls:
            return [self._choice(held, finish_reason, logprobs=True)]
        out = [self._choice(content or "", None, logprobs=True)] if content or not self.started else []
        out.append(self._ids({"index": self.index, "delta": {"tool_calls": tool_call_list(calls)}, "logprobs": None,
                              "finish_reason": None}))
        out.append({"index": self.index, "delta": {}, "logprobs": None,
                    "finish_reason": "tool_calls" if finish_reason == "stop" else finish_reason})
        return out

    def _choice(self, text: str, finish_reason: str | None, logprobs: bool, field: str = "content") -> dict:
        entries, self.pending_logprobs = self.pending_logprobs, []
        first, self.started = not self.started, True
        if not self.chat:
            text = (self.prefix if first else "") + text
            echoed_logprobs = first and entries and entries[0].logprob is None  # they start at the prompt
            offset = self.text_offset + (len(self.prefix) if first and not echoed_logprobs else 0)
            self.text_offset += len(text)
            lp = completion_logprobs(entries, offset) if logprobs and entries else None
            choice = self._ids({"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish_reason})
            if first and self.prompt_token_ids is not None:
                choice["prompt_token_ids"] = self.prompt_token_ids
            return choice
        delta = {"content": text} if field == "content" else reasoning_fields(text)
        delta = {"role": "assistant", **delta} if first else (delta if text else {})
        lp = chat_logprobs(entries) if logprobs and entries else None
        return self._ids({"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason})

    def _ids(self, choice: dict) -> dict:
        """vLLM's `token_ids` on a chunk choice: the ids that came since the last, when asked for."""
        if self.pending_token_ids is not None:
            choice["token_ids"], self.pending_token_ids = self.pending_token_ids, []
        return choice


def chunk_body(request_id: str, model: str, choices: list[dict], chat: bool, created: int) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": choices}


_encode = msgspec.json.Encoder().encode
KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, idle-timeout proxies see bytes


class CompletionResponse(JSONResponse):
    """A whole completion, rendered by msgspec: an echo with logprobs is megabytes, which json.dumps took 117 ms
    to render (msgspec 15) on the event loop that also feeds every other stream."""

    def render(self, content: dict) -> bytes:
        return _encode(content)


def sse(payload: dict) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def sse_event(kind: str, payload: dict) -> bytes:
    """An SSE event with its type named, as the Responses API streams them."""
    return b"event: " + kind.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


async def retold_stream(chunks, events, keep_alive: bytes | str, stream_error, request_id: str):
    """A chat stream retold as another API's events (the Responses and Messages APIs'): `events` gives those of its
    start, of each chunk, of its finish, and of a failure's envelope (`stream_error(exc, request_id)`). The chunks are
    closed at once when the client goes, so the engine stops the request then."""
    for event in events.start():
        yield event
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                for event in [keep_alive] if chunk is None else events.chunk(chunk):
                    yield event
        for event in events.finish():
            yield event
    except Exception as exc:
        for event in events.fail(stream_error(exc, request_id)):
            yield event
