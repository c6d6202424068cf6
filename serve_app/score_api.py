"""vLLM's score and rerank routes for an embedding model (`POST /v1/score`, `POST /v1/rerank`, Cohere's and Jina's
shape): each text pair's score is the cosine similarity of the two texts' embeddings, as vLLM scores with a model that
embeds (a cross-encoder's head is not served here). Every field is served or refused with a 400 that names it."""
from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from engine.errors import EngineInputError
from engine.pooling_params import PoolingParams
from engine.scoring import check_pairs
from serve_app.embeddings_api import MAX_INPUTS
from serve_app.openai_protocol import check_unicode, refuse, refuse_asked
from serve_app.security import REQUEST_ID


# vLLM's fields for a cross-encoder's chat template and inputs: field -> (the values that ask for nothing, why refused)
CROSS_ENCODER_FIELDS: dict[str, tuple[tuple, str]] = {
    "instruction": ((None,), "an instruction for a cross-encoder's chat template (scores here are cosine similarities "
                             "of embeddings)"),
    "chat_template_kwargs": ((None, {}), "chat template variables (scores here are cosine similarities of embeddings)"),
    "max_tokens_per_query": ((None, 0), "per-query truncation (truncate_prompt_tokens bounds each text)"),
    "max_tokens_per_doc": ((None, 0), "per-document truncation (truncate_prompt_tokens bounds each text)"),
    "padding": ((None, "do_not_pad"), "padding (no model here needs it)"),
    "truncation_side": ((None, "left"), "truncation_side right (truncate_prompt_tokens keeps each text's end)"),
}
# vLLM's spellings of a score request's two sides: (first, second), text_1 and text_2 the oldest
SCORE_SPELLINGS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class _PairRequest(BaseModel):
    """The fields the two routes share, and their refusals."""
    model_config = ConfigDict(extra="ignore")  # as the other OpenAI routes: vLLM's fields we do not serve are refused below

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, description="keep each text's last k tokens")
    priority: int = 0
    request_id: str | None = Field(default=None, pattern=REQUEST_ID.pattern, description="the response's id")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256,
                                   description="prefix-cache blocks are shared only with the same salt")
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        check_unicode(data)
        if data.get("mm_processor_kwargs") is not None:
            raise refuse("mm_processor_kwargs", "multimodal inputs")
        for field in ("use_activation", "activation", "softmax"):
            if data.get(field) is False:
                raise refuse(field, f"{field} false (a cosine similarity of embeddings has no activation to leave out)")
        refuse_asked(data, CROSS_ENCODER_FIELDS)
        return data

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(normalize=True, truncate_prompt_tokens=self.truncate_prompt_tokens)

    @staticmethod
    def _check_texts(field: str, texts: list[str]) -> None:
        if not texts:
            raise PydanticCustomError("texts", "{field} holds no text", {"field": field, "path": field})
        empty = next((i for i, text in enumerate(texts) if not text), None)
        if empty is not None:
            raise PydanticCustomError("texts", "{field} {index} is empty", {"field": field, "index": empty, "path": field})


class ScoreRequest(_PairRequest):
    """The first side against the second: one text against each of many, or pair by pair where both are lists of one
    length. The sides are text_1 and text_2, or as vLLM 0.32 spells them also queries and documents, queries and
    items, or data_1 and data_2: one spelling."""
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None

    @model_validator(mode="after")
    def _pairs(self) -> "ScoreRequest":
        present = {side for pair in SCORE_SPELLINGS for side in pair if getattr(self, side) is not None}
        if present not in [set(pair) for pair in SCORE_SPELLINGS]:
            names = "; ".join(" and ".join(pair) for pair in SCORE_SPELLINGS)
            raise PydanticCustomError("texts", "the two sides to score, in one spelling ({names}), got {given}",
                                      {"names": names, "given": ", ".join(sorted(present)) or "none",
                                       "path": sorted(present)[0] if present else "text_1"})
        first_name, second_name = self.sides
        first, second = self.firsts, self.seconds
        self._check_texts(first_name, first)
        self._check_texts(second_name, second)
        try:
            check_pairs(len(first), len(second), self.sides)
        except EngineInputError as exc:
            raise PydanticCustomError("texts", str(exc), {"path": exc.param}) from None
        if len(first) + len(second) > MAX_INPUTS:
            raise PydanticCustomError("texts", "at most {limit} texts in one request, got {count}",
                                      {"limit": MAX_INPUTS, "count": len(first) + len(second), "path": second_name})
        return self

    @property
    def sides(self) -> tuple[str, str]:
        """The names of the two sides as the request spells them."""
        return next(pair for pair in SCORE_SPELLINGS if getattr(self, pair[1]) is not None)

    def texts(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Every text to embed, the first side's first, with each one's field and name for errors."""
        (first_name, second_name), firsts, seconds = self.sides, self.firsts, self.seconds
        return firsts + seconds, (_named(first_name, firsts, getattr(self, first_name))
                                  + _named(second_name, seconds, getattr(self, second_name)))

    @property
    def firsts(self) -> list[str]:
        return _as_list(getattr(self, self.sides[0]))

    @property
    def seconds(self) -> list[str]:
        return _as_list(getattr(self, self.sides[1]))


class RerankRequest(_PairRequest):
    """A query against documents, the most relevant first."""
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0, description="how many results; 0: every document")
    return_documents: bool = Field(default=True, description="false: results without the documents' text")

    @model_validator(mode="after")
    def _texts(self) -> "RerankRequest":
        self._check_texts("query", [self.query])
        self._check_texts("documents", self.documents)
        if 1 + len(self.documents) > MAX_INPUTS:
            raise PydanticCustomError("texts", "at most {limit} documents in one request, got {count}",
                                      {"limit": MAX_INPUTS - 1, "count": len(self.documents), "path": "documents"})
        return self

    def texts(self) -> tuple[list[str], list[tuple[str, str]]]:
        """The query, then the documents, with each one's field and name for errors."""
        return [self.query, *self.documents], [("query", "query"), *_named("documents", self.documents, self.documents)]


def _as_list(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)


def _named(field: str, texts: list[str], given: str | list[str]) -> list[tuple[str, str]]:
    return [(field, field if isinstance(given, str) else f"{field} {i}") for i in range(len(texts))]


def score_body(request_id: str, model: str, scores: list[float], prompt_tokens: int) -> dict:
    return {"id": f"score-{request_id}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def rerank_body(request_id: str, model: str, body: RerankRequest, scores: list[float], prompt_tokens: int) -> dict:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
    return {"id": f"rerank-{request_id}", "model": model, "usage": {"total_tokens": prompt_tokens}, "results": results}
