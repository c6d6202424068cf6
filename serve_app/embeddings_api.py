"""OpenAI's `POST /v1/embeddings` (and vLLM's extensions of it): the request, and the response body from the replica's
float32 vectors. Every field is served or refused with a 400 that names it."""
from __future__ import annotations

import base64
import sys
import time
from array import array
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.pooling_params import PoolingParams
from serve_app.openai_protocol import check_unicode, refuse
from serve_app.security import REQUEST_ID
from pydantic_core import PydanticCustomError

MAX_INPUTS = 2048  # OpenAI's own bound on one request's inputs


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as the other OpenAI routes: vLLM's fields we do not serve are refused below

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, description="keep the input's last k tokens")
    use_activation: bool | None = Field(default=None, description="false: the hidden state as it is, not unit length")
    endianness: Literal["native", "little", "big"] = "native"
    request_id: str | None = Field(default=None, pattern=REQUEST_ID.pattern, min_length=1, max_length=128)
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256,
                                   description="prefix-cache blocks are shared only with the same salt")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        check_unicode(data)
        refused = {
            "messages": "chat messages as an embedding's input (send the text as input)",
            "mm_processor_kwargs": "multimodal inputs", "padding": "padding (no model here needs it)",
            # vLLM's chat-embedding fields, which apply to messages only
            **{field: "chat options for an embedding (its input is text or token ids, not messages)" for field in
               ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                "media_io_kwargs")},
        }
        for field, why in refused.items():
            if data.get(field) not in (None, "do_not_pad" if field == "padding" else None):
                raise refuse(field, why)
        if data.get("truncation_side") not in (None, "left"):
            raise refuse("truncation_side", "truncation_side right (truncate_prompt_tokens keeps the input's end)")
        if data.get("embed_dtype") not in (None, "float32"):
            raise refuse("embed_dtype", "embeddings other than float32")
        if data.get("add_special_tokens") is False:
            raise refuse("add_special_tokens", "add_special_tokens false (a text input starts as the tokenizer starts "
                         "it; token ids are sent as they are)")
        return data

    @model_validator(mode="after")
    def _bounded(self) -> "EmbeddingRequest":
        if len(self.inputs) > MAX_INPUTS:
            raise PydanticCustomError("input", "at most {limit} inputs in one request, got {count}",
                                      {"limit": MAX_INPUTS, "count": len(self.inputs), "path": "input"})
        empty = next((i for i, text in enumerate(self.inputs) if not text), None)
        if empty is not None:
            which = f"input {empty}" if len(self.inputs) > 1 else "input"
            raise PydanticCustomError("input", "{which} is empty", {"which": which, "path": "input"})
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        """The inputs in order: one text or token list, or a batch of them."""
        batch = isinstance(self.input, list) and self.input and not isinstance(self.input[0], int)
        return list(self.input) if batch else [self.input]

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(normalize=self.use_activation is not False, dimensions=self.dimensions,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


def response_body(request_id: str, model: str, vectors: list[bytes], prompt_tokens: int, encoding_format: str,
                  endianness: str) -> dict:
    """OpenAI's list of embeddings (with vLLM's `id` and `created`): floats, or base64 of the float32 bytes as the
    `openai` client asks for by default and decodes with numpy."""
    swap = endianness != "native" and endianness != sys.byteorder
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding_format, swap)}
            for i, v in enumerate(vectors)]
    return {"id": f"embd-{request_id}", "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _encoded(vector: bytes, encoding_format: str, swap: bool) -> list[float] | str:
    """`vector`: little-endian float32, as the engine sends it."""
    values = array("f", vector)
    if sys.byteorder != "little":
        values.byteswap()
    if encoding_format == "float":
        return values.tolist()
    if swap:
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")
