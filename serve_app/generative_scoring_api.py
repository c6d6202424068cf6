"""vLLM's generative scoring (`POST /generative_scoring`, vLLM 0.32): how likely a generative model finds each label
token right after a query joined with each item. An item's score is the first label's probability, over the labels
alone (`apply_softmax`) or over the whole vocabulary; one generation of one token per item, whose logprob_token_ids
are the labels. Not an OpenAI route: a field this server does not know is refused."""
from __future__ import annotations

import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

from engine.prompt_part import PromptPart
from engine.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams
from serve_app.errors import OpenAIError
from serve_app.openai_protocol import MAX_PROMPTS, check_unicode
from serve_app.protocol import TokenLogprob
from serve_app.security import REQUEST_ID


class GenerativeScoringRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    query: str | list[NonNegativeInt]
    items: list[str] | list[list[NonNegativeInt]] = Field(min_length=1, max_length=MAX_PROMPTS)
    label_token_ids: list[NonNegativeInt] = Field(min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)
    apply_softmax: bool = Field(default=True, description="false: each label's probability over the whole vocabulary")
    item_first: bool = Field(default=False, description="each prompt is the item, then the query")
    add_special_tokens: bool = Field(default=True, description="a text query is encoded with the special tokens")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    priority: int = 0
    request_id: str | None = Field(default=None, pattern=REQUEST_ID.pattern)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data

    def prompts(self) -> list[list[PromptPart]]:
        """Each item joined with the query, as vLLM joins them: an item's text without special tokens (no second
        BOS), the query's with them where add_special_tokens."""
        query = PromptPart(self.query, "query", special_tokens=self.add_special_tokens)
        items = [PromptPart(item, f"items[{i}]") for i, item in enumerate(self.items)]
        return [[item, query] if self.item_first else [query, item] for item in items]

    def sampling_params(self) -> SamplingParams:
        """One greedy token, the labels' logprobs beside it; a prompt too long keeps its first tokens (vLLM's)."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=list(self.label_token_ids),
                              truncate_prompt_tokens=-1, truncation_side="right")

    def score(self, label_logprobs: list[float]) -> float:
        """The first label's probability, over the labels alone where apply_softmax, else the model's own."""
        if not self.apply_softmax:
            return math.exp(label_logprobs[0])
        top = max(label_logprobs)
        return math.exp(label_logprobs[0] - top) / sum(math.exp(lp - top) for lp in label_logprobs)


def label_logprobs(first: TokenLogprob, labels: list[int]) -> list[float]:
    """The labels' logprobs, in the request's order, from its one token's entry (whose top are the listed ids)."""
    listed = dict(zip(first.top_ids, (logprob for _, logprob, _ in first.top)))
    return [listed[label] for label in labels]


def renamed(error: OpenAIError) -> OpenAIError:
    """The engine's refusal of logprob_token_ids is one of label_token_ids, as the request spells them."""
    if error.param != "logprob_token_ids":
        return error
    return OpenAIError(error.status, error.message.replace("logprob_token_ids", "label_token_ids"), "label_token_ids")


def response_body(request_id: str, model: str, scores: list[float], prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": f"generative-scoring-{request_id}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
