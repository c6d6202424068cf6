"""AppArgs: everything `build_app` takes, typed. Serve configs pass these as `args`."""
from __future__ import annotations

import os
from pathlib import PurePath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.config import DEFAULT_MODEL, EngineConfig


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # the model and engine
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    quantization: Literal["nf4", "int8"] | None = None
    device: str = "auto"
    num_threads: int | None = Field(default=None, ge=1, description="torch threads per replica; default: node cores")
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = Field(default=128, ge=1)
    max_num_batched_tokens: int = Field(default=1024, ge=16)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_waiting: int = Field(default=256, ge=1, description="queued requests per replica before 429")

    # placement and scaling
    num_gpus: float = Field(default=0, ge=0, description="per engine replica; 1 on a GPU cluster")
    num_cpus: float = Field(default=1, ge=0, description="per engine replica (logical CPUs Ray reserves)")
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    target_ongoing_requests: float | None = Field(default=None, gt=0, description="default: max_num_seqs")
    upscale_delay_s: float = Field(default=30, ge=0, description="Serve autoscaling: sustained load before adding")
    downscale_delay_s: float = Field(default=600, ge=0, description="Serve autoscaling: sustained idleness before removing")
    look_back_period_s: float = Field(default=30, gt=0, description="Serve autoscaling: window of the load average")
    ingress_max_replicas: int = Field(default=2, ge=1)
    ingress_resources: dict[str, float] = Field(default_factory=dict,
                                                description="custom Ray resources that pin the ingress, e.g. {head: 0.01}")
    max_queued_requests: int = Field(default=1024, description="Serve's own per-caller queue: the last resort")

    # HTTP behaviour
    api_key: str | None = Field(default_factory=lambda: os.environ.get("LLM_SERVE_API_KEY") or None)
    allow_unauthenticated: bool = Field(default=False, description="start without api_key on a non-loopback address")
    default_max_tokens: int | None = Field(default=None, ge=1, description="when a request gives none")
    max_tokens_limit: int = Field(default=4096, ge=1, description="cap on max_tokens: caps the default, refuses more")
    request_timeout_s: float = Field(default=600, gt=0)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    body_timeout_s: float = Field(default=30, gt=0, description="the whole request body must arrive within this")
    sse_keepalive_s: float = Field(default=15, gt=0, description="an SSE comment after this long without a chunk")
    openapi_url: str | None = Field(default="/openapi.json", description="None hides the schema")
    retry_after_s: int = Field(default=1, ge=0)
    graceful_shutdown_timeout_s: float | None = Field(
        default=None, ge=0, description="drain on shutdown; default: request_timeout_s + 10, since no accepted "
                                        "request runs longer, so a deploy never cuts a generation short")
    log_prompts: bool = Field(default=False, description="debug only: prompts and completions in logs")

    @property
    def drain_timeout_s(self) -> float:
        if self.graceful_shutdown_timeout_s is not None:
            return self.graceful_shutdown_timeout_s
        return self.request_timeout_s + 10

    @property
    def model_name(self) -> str:
        return self.served_model_name or PurePath(self.model).name

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, quantization=self.quantization, device=self.device,
            num_threads=self.num_threads, block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, max_waiting=self.max_waiting,
            default_max_tokens=self.default_max_tokens, max_tokens_limit=self.max_tokens_limit,
        )

    @property
    def replica_max_ongoing_requests(self) -> int:
        # every running and queued request holds a streaming call open on the replica
        return self.max_num_seqs + self.max_waiting + 32  # headroom so the engine, not Serve, answers overload
