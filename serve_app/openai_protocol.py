"""The OpenAI request and response shapes we accept and produce. Unknown request fields are ignored."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


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


class SamplingFields(BaseModel):
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
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is supported")
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: benchmarks need fixed output lengths
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256,
                                   description="vLLM's extension: prefix-cache blocks are shared only with the same salt")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, text: str, finish_reason: str | None, chat: bool,
                    usage_: dict | None = None, created: int | None = None) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    body = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": created or int(time.time()), "model": model, "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chunk_body(request_id: str, model: str, text: str, finish_reason: str | None, chat: bool, created: int,
               first: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}
