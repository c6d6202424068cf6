"""The messages between the ingress and an engine replica: a job in, then an admission (or a refusal) and deltas out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine import SamplingParams
from engine.beam_search import BeamSearchParams
from engine.chat import DEFAULT_OPTIONS, ChatOptions
from engine.engine_stats import EngineStats
from engine.prompt_part import PromptPart
from engine.pooling_params import PoolingParams
from serve_app.reasoning import ReasoningFormat, ThinkingLimit


@dataclass
class GenerationJob:
    request_id: str
    prompt: str | list[int] | list[dict[str, Any]] | list[PromptPart]  # text, ids, chat messages or parts joined
    params: SamplingParams
    n: int = 1  # choices; each is its own engine request sharing the prompt's KV blocks
    cache_salt: str | None = None
    tools: list[dict[str, Any]] | None = None  # offered to the model through the chat template
    echo: bool = False  # completions: the prompt's text comes back in Admitted
    stream_interval: int | None = 1  # tokens per Delta after a choice's first; None: one Delta per choice, at its end
    stream_chunks_per_step: int | None = None  # set: stream_interval is the most, adapted to the replica's streams
    least_stream_interval: int = 1  # the request's own stream_interval (vLLM's): no adapted interval goes below it
    chat: ChatOptions = DEFAULT_OPTIONS  # how chat messages become the prompt
    return_token_ids: bool = False  # the prompt's ids in Admitted, each delta's new ids in it (vLLM's field)
    return_tokens_as_token_ids: bool = False  # logprobs name each token "token_id:<id>" (vLLM's field)
    return_prompt_text: bool = False  # the prompt's text in Admitted, as echo has it (vLLM's return_prompt_text)
    priority: int = 0  # the engine's priority policy serves a lower value first; its fcfs policy refuses any other
    lora_name: str | None = None  # the LoRA adapter the request named as its model; None: the base model
    reasoning: ReasoningFormat | None = None  # the app's reasoning parser, for a chat: its constraint waits for the end
    thinking: ThinkingLimit | None = None  # vLLM's thinking_token_budget, with the app's reasoning parser's markers
    beam: BeamSearchParams | None = None  # vLLM's use_beam_search: the n choices are the best beams of width n
    # the sampling fields the request left unset, which the model's defaults fill (engine/sampling_defaults.py)
    defaulted: frozenset[str] = frozenset()


@dataclass
class EmbeddingJob:
    """An embeddings request: each input is an engine request of its own, pooled, not sampled."""

    request_id: str
    inputs: list[str | list[int]]
    pooling: PoolingParams
    priority: int = 0
    lora_name: str | None = None
    # each input's field and name in errors, where they are not the embeddings API's ("input", "input i"): e.g.
    # ("documents", "documents 3") for the rerank route
    sources: list[tuple[str, str]] | None = None
    cache_salt: str | None = None  # prefix-cache blocks are shared only with the same salt (vLLM's field)


@dataclass
class Embeddings:
    """An embedding job's result: each input's vector (little-endian float32 bytes), in order, and its tokens."""

    vectors: list[bytes]
    prompt_tokens: int


@dataclass
class Admitted:
    prompt_tokens: int
    prompt_text: str | None = None  # the prompt as text, for completions' echo and a chat's return_prompt_text
    prompt_token_ids: list[int] | None = None  # when the job asks for token ids


@dataclass
class Refused:
    status: int  # the HTTP status the ingress sends
    message: str
    param: str | None = None
    code: str | None = None


@dataclass
class Tokens:
    """A prompt's token ids (vLLM's /tokenize), and each one's string in the vocabulary when asked for."""

    ids: list[int]
    strs: list[str] | None = None


@dataclass
class TokenLogprob:
    token: str
    logprob: float | None  # None for a prompt's first token, which nothing predicts
    bytes: list[int]
    top: list[tuple[str, float, list[int]]] = field(default_factory=list)  # most likely first
    # a prompt token's, for vLLM's prompt_logprobs (keyed by token id, with ranks): its id, its rank, the top's ids
    # (top_ids also where the top are the ids a request listed, logprob_token_ids)
    token_id: int | None = None
    rank: int | None = None
    top_ids: list[int] | None = None


@dataclass
class Delta:
    """What is new for one choice since its last delta."""

    index: int
    text: str
    completion_tokens: int  # cumulative, for usage
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: every choice's, on the request's first delta
    error_param: str | None = None  # the request field at fault, when the error is the request's own (a 400)
    token_ids: list[int] | None = None  # the new tokens' ids, when the job asks for them
    reasoning_tokens: int | None = None  # with the job's reasoning format, on the choice's last delta: its thinking's
    stop_reason: int | str | None = None  # vLLM's, on the choice's last delta: the stop string or token id that ended it


@dataclass
class Placement:
    """Where a replica runs."""

    replica_id: str
    node_id: str
    gpu_ids: list[str]


@dataclass
class ReplicaStats:
    """What an engine replica answers to `stats()`: its engine's stats, where it runs and whether it is healthy."""

    engine: EngineStats
    placement: Placement
    time: float  # when it was read (the replica's clock)
    health_problem: str | None = None
