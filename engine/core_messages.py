"""What crosses between the front end and the engine core, typed: one message per step each way (msgpack)."""
from __future__ import annotations

import msgspec

from engine.engine_stats import EngineStats
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sequence import RequestMetrics


class ModelLimits(msgspec.Struct, frozen=True):
    """What the front end must know about the loaded model to validate a request without it."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # every KV block; a prompt this long can never be scheduled
    eos_token_ids: list[int]
    hidden_size: int = 0  # an embedding's length
    # the lengths an embedding may be cut to (`dimensions`): None, the model was not trained for it; empty, any
    matryoshka_dimensions: list[int] | None = None
    # the model's recommended sampling (engine/sampling_defaults.py) for requests that leave a field unset
    sampling_defaults: dict[str, float] = {}


class EngineRequest(msgspec.Struct):
    """A request the front end has tokenized and validated: the core only schedules it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved by the front end's one max_tokens policy
    arrival_time: float  # time.monotonic(): one clock for every process on the host
    cache_salt: str | None = None
    prompt_leader: str | None = None  # an earlier request with the same prompt (the choices of n > 1)
    priority: int = 0  # the scheduling policy "priority" serves a lower value first
    lora_name: str | None = None  # the LoRA adapter (EngineConfig.lora_modules) it runs; None: the base model
    pooling: PoolingParams | None = None  # set: an embedding request, which ends after its prompt (max_tokens 0)


class CoreInputs(msgspec.Struct):
    """Front end -> core: new requests and aborts since the last message; `shutdown` ends the core."""

    requests: list[EngineRequest] = []
    aborts: dict[str, str] = {}  # request id -> the reason it ends with: abort, or stop for a stop string found
    metrics_model_name: str | None = None  # start reporting step metrics under this model name
    shutdown: bool = False


class CoreOutput(msgspec.Struct):
    """One request's progress in one step, in token ids: what is new only; the front end detokenizes, checks stop
    strings and keeps the totals."""

    request_id: str
    new_token_ids: list[int]
    metrics: RequestMetrics
    finish_reason: str | None = None
    error: str | None = None
    new_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, with the request's first output
    error_param: str | None = None  # the request field at fault, when the error is the request's own (a 400)
    prompt_ranks: list[int | None] | None = None  # with prompt_logprobs: each prompt token's rank
    embedding: bytes | None = None  # an embedding request's result: float32 values, little-endian
    stop_token_id: int | None = None  # with finish_reason "stop": the stop token id that ended it (not an honoured EOS)


class MetricUpdate(msgspec.Struct, array_like=True):
    """A call the core's StepMetrics made on its sink, replayed on the front end's (which Ray's metrics need)."""

    kind: str  # inc, set or observe
    name: str
    value: float | list[float]
    labels: dict[str, str]


class CoreOutputs(msgspec.Struct, tag=True):
    """Core -> front end, after every step: outputs, the engine's stats and the metric updates of that step."""

    outputs: list[CoreOutput]
    stats: EngineStats
    metric_updates: list[MetricUpdate] = []


class CoreReady(msgspec.Struct, tag=True):
    """Core -> front end, once, when the model is loaded and warm."""

    limits: ModelLimits
    settings: dict[str, str | int | float | bool | None]
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag=True):
    """Core -> front end, instead of CoreReady, when the engine could not start."""

    error: str


class CoreSetup(msgspec.Struct):
    """Front end -> core, as the one line on the core's stdin (which then stays open: its end is the parent's)."""

    config_json: str  # EngineConfig.model_dump_json()
    inputs_address: str
    outputs_address: str


FromCore = CoreReady | CoreFailed | CoreOutputs
