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
from serve_app.openai_protocol import check_unicode, refuse


class _PairRequest(BaseModel):
    """The fields the two routes share, and their refusals."""
    model_config = ConfigDict(extra="ignore")  # as the other OpenAI routes: vLLM's fields we do not serve are refused below

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, description="keep each text's last k tokens")
    priority: int = 0

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
    """text_1 against text_2: one against each of many, or pair by pair where both are lists of one length."""
    text_1: str | list[str]
    text_2: str | list[str]

    @model_validator(mode="after")
    def _pairs(self) -> "ScoreRequest":
        first, second = self.firsts, self.seconds
        self._check_texts("text_1", first)
        self._check_texts("text_2", second)
        try:
            check_pairs(len(first), len(second))
        except EngineInputError as exc:
            raise PydanticCustomError("texts", str(exc), {"path": exc.param}) from None
        if len(first) + len(second) > MAX_INPUTS:
            raise PydanticCustomError("texts", "at most {limit} texts in one request, got {count}",
                                      {"limit": MAX_INPUTS, "count": len(first) + len(second), "path": "text_2"})
        return self

    def texts(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Every text to embed, text_1's first, with each one's field and name for errors."""
        firsts, seconds = self.firsts, self.seconds
        return firsts + seconds, _named("text_1", firsts, self.text_1) + _named("text_2", seconds, self.text_2)

    @property
    def firsts(self) -> list[str]:
        return [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)

    @property
    def seconds(self) -> list[str]:
        return [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)


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
