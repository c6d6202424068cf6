"""AppArgs: everything `build_app` takes, typed. Serve configs pass these as `args`."""
from __future__ import annotations

import os
from pathlib import Path, PurePath
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.config import EngineConfig
from serve_app.autoscaling import EngineSignalTargets
from serve_app.prefix_affinity import PrefixAffinityOptions
from serve_app.reasoning import ReasoningParserName

# What serving needs that the offline engine does not: a bounded queue (429 past it), a cap on max_tokens, and the
# core in a process of its own, so the replica's HTTP and Ray messaging never share an interpreter lock with it.
SERVING_ENGINE_DEFAULTS = {"max_waiting": 256, "max_tokens_limit": 4096, "engine_process": True}


class ModelArgs(BaseModel):
    """One served model: its engine, the names it answers to, its parsers, and its replicas' placement and scaling.
    An app serves the model its top-level args describe and, in `models`, any others, each on replicas of its own."""
    model_config = ConfigDict(extra="forbid")

    # the engine: every EngineConfig knob, set under `engine_config:` in a Serve config
    engine_config: EngineConfig = Field(default_factory=lambda: EngineConfig(**SERVING_ENGINE_DEFAULTS))
    served_model_name: str | list[str] | None = Field(default=None, description=(
        "vLLM's --served-model-name: the name requests give as `model`; several: any of them is accepted and echoed, "
        "the first is the one listed first and the metrics' label. None: the model path's last part"))
    tool_call_parser: Literal["hermes", "llama3_json"] = Field(default="hermes", description=(
        "vLLM's --tool-call-parser: the format tool calls are parsed from, forced in, and described in for a chat "
        "template that cannot render tools: hermes (<tool_call> tags: Qwen2.5, Hermes, SmolLM2) or llama3_json "
        "(a bare {\"name\", \"parameters\"} object: Llama 3.1-3.3)"))
    reasoning_parser: ReasoningParserName | None = Field(default=None, description=(
        "vLLM's --reasoning-parser: a reasoning model's thinking comes back as `reasoning` apart from its answer "
        "(deepseek_r1: the template opens <think>; qwen3: the model does, or not), and a constraint (response_format, "
        "a forced tool call) applies after </think>"))

    # placement and scaling
    num_gpus: float = Field(default=0, ge=0, description="per engine replica; 1 on a GPU cluster")
    num_cpus: float = Field(default=1, ge=0, description="per engine replica (logical CPUs Ray reserves)")
    accelerator_type: str | None = Field(default=None, description=(
        "Ray Serve LLM's: the GPU kind this model's replicas run on, as Ray names it (H100, A100-80G, L4, ...), "
        "so models of different sizes land on different GPU nodes; None: any GPU"))
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    target_ongoing_requests: float | None = Field(default=None, gt=0, description="default: max_num_seqs")
    upscale_delay_s: float = Field(default=30, ge=0, description="Serve autoscaling: sustained load before adding")
    downscale_delay_s: float = Field(default=600, ge=0, description="Serve autoscaling: sustained idleness before removing")
    look_back_period_s: float = Field(default=30, gt=0, description="Serve autoscaling: window of the load average")
    autoscaling_policy: Literal["requests", "engine"] = Field(default="requests", description=(
        "requests: Serve's default, ongoing requests against target_ongoing_requests; engine: KV pool use, the "
        "waiting queue, preemptions and TTFT p90 against engine_signal_targets (serve_app/autoscaling.py)"))
    engine_signal_targets: EngineSignalTargets = Field(default_factory=EngineSignalTargets)
    topology: Literal["split", "colocated"] = Field(default="split", description=(
        "split: the ingress and the engine replicas are deployments of their own, the ingress scaling apart on "
        "CPUs; colocated: each engine replica serves HTTP itself, one Ray hop less per request and per streamed "
        "chunk (serve_app/colocated.py); the ingress_* fields then do not apply"))
    request_router: Literal["power_of_two", "prefix_affinity"] = Field(default="power_of_two", description=(
        "how the ingress picks an engine replica for a generation: power_of_two, Serve's default, the less busy of "
        "two at random; prefix_affinity, the replica that was sent the longest start of the prompt, whose prefix "
        "cache likely holds it (serve_app/prefix_router.py). Split topology only: in colocated, Serve's proxy "
        "picks the replica before the body is read"))
    prefix_affinity: PrefixAffinityOptions = Field(default_factory=PrefixAffinityOptions)
    adapter_affinity: bool = Field(default=True, description=(
        "split topology: a request on a LoRA adapter loaded on demand (lora_root) goes to a replica that holds it, "
        "as Ray Serve LLM routes LoRA requests (serve_app/adapter_affinity.py); False: as any other request, which "
        "spreads one hot adapter's load over every replica at the cost of each loading it"))

    @field_validator("engine_config", mode="before")
    @classmethod
    def _serving_defaults(cls, value):
        return {**SERVING_ENGINE_DEFAULTS, **value} if isinstance(value, dict) else value

    @field_validator("served_model_name")
    @classmethod
    def _names_apart(cls, value):
        """One name or several, kept as a list."""
        names = [value] if isinstance(value, str) else value
        if names is not None and (not names or not all(names) or len(set(names)) != len(names)):
            raise ValueError("served_model_name: one or more distinct, non-empty names")
        return names

    @field_validator("accelerator_type")
    @classmethod
    def _known_accelerator(cls, value):
        if value is not None and value not in ray_accelerator_types():
            raise ValueError(f"accelerator_type: {value!r} is not an accelerator type Ray knows "
                             f"({', '.join(sorted(ray_accelerator_types()))})")
        return value

    @model_validator(mode="after")
    def _accelerator_needs_gpus(self):
        if self.accelerator_type is not None and not self.num_gpus:
            raise ValueError("accelerator_type: the replicas ask for no GPU (num_gpus: 0)")
        return self

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def model_names(self) -> list[str]:
        """Every name the base model is served as, the first foremost."""
        return self.served_model_name or [PurePath(self.engine_config.model).name]

    @property
    def replica_max_ongoing_requests(self) -> int:
        # every running and queued request holds a streaming call open on the replica
        # so the engine, not Serve, answers overload
        return self.engine_config.max_num_seqs + (self.engine_config.max_waiting or 0) + 32


class AppArgs(ModelArgs):
    """The app's args: the first model (ModelArgs' fields), the others in `models`, and what the server does for all."""

    models: list[ModelArgs] = Field(default_factory=list, description=(
        "more models, as Ray Serve LLM's llm_configs: each on engine replicas of its own (deployment "
        "EngineReplica:<its name>), placed and scaled by its own fields, behind the one ingress, which routes a "
        "request by its `model`; with several, a request must name one. Split topology only"))
    ingress_min_replicas: int = Field(default=1, ge=1)
    ingress_max_replicas: int = Field(default=2, ge=1)
    ingress_resources: dict[str, float] = Field(default_factory=dict,
                                                description="custom Ray resources that pin the ingress, e.g. {head: 0.01}")
    max_queued_requests: int = Field(default=1024, description="Serve's own per-caller queue: the last resort")

    # HTTP behaviour
    api_key: str | None = Field(default_factory=lambda: os.environ.get("LLM_SERVE_API_KEY") or None)
    allow_unauthenticated: bool = Field(default=False, description="start without api_key on a non-loopback address")
    request_timeout_s: float = Field(default=600, gt=0)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    body_timeout_s: float = Field(default=30, gt=0, description="the whole request body must arrive within this")
    stream_interval: int = Field(default=1, ge=1, description=(
        "tokens per streamed chunk after the first, as vLLM's --stream-interval: fewer, fuller chunks cost the "
        "serving processes less CPU under load; the first token and the end are never held back. With "
        "stream_chunks_per_step set, the most tokens per chunk"))
    stream_chunks_per_step: int | None = Field(default=None, ge=1, description=(
        "adapt the interval to load: a replica streaming to s clients sends chunks of ceil(s / this) tokens, up to "
        "stream_interval, so about this many chunks leave it per engine step whatever the batch; one client gets "
        "every token. None: always stream_interval"))
    report_cached_tokens: bool = Field(default=False, description=(
        "usage.prompt_tokens_details.cached_tokens on every response; False: only on requests with a cache_salt, "
        "since for unsalted ones it shows whether another client sent the same prefix (vLLM: "
        "--enable-prompt-tokens-details)"))
    sse_keepalive_s: float = Field(default=15, gt=0, description="an SSE comment after this long without a chunk")
    openapi_url: str | None = Field(default="/openapi.json", description="None hides the schema")
    retry_after_s: int = Field(default=1, ge=0)
    graceful_shutdown_timeout_s: float | None = Field(
        default=None, ge=0, description="drain on shutdown; default: request_timeout_s + 10, since no accepted "
                                        "request runs longer, so a deploy never cuts a generation short")
    max_prompt_logprob_tokens: int = Field(default=4096, ge=1, description=(
        "the longest prompt that echo with logprobs may score (each token is a log-softmax over the vocabulary); "
        "longer is a 400 naming echo"))
    max_n: int = Field(default=8, ge=1, description="choices per request (OpenAI's n); each is an engine request")
    log_prompts: bool = Field(default=False, description="debug only: prompts and completions in logs")

    @model_validator(mode="after")
    def _router_needs_split(self):
        if self.request_router == "prefix_affinity" and self.topology != "split":
            raise ValueError("request_router: prefix_affinity needs topology: split (in colocated, Serve's proxy "
                             "routes a request before its body, and so its prompt, is read)")
        return self

    @model_validator(mode="after")
    def _models_apart(self):
        """Several models need the split topology's ingress to route between them, and names that say which one."""
        if self.models and self.topology != "split":
            raise ValueError("models: several models need topology: split (a colocated replica serves one engine)")
        names = [name for model in self.served_models
                 for name in model.model_names + model.engine_config.lora_module_names]
        if len(set(names)) != len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"models: each model and LoRA adapter needs a name of its own; {twice} name more than "
                             "one (served_model_name tells models of the same path apart)")
        return self

    @property
    def served_models(self) -> list[AppArgs]:
        """Each model's args, the app's first: its own fields with the app's server-wide ones, as its replicas and
        the ingress's route to it read them."""
        first = self.model_copy(update={"models": []})
        return [first] + [first.model_copy(update={name: getattr(model, name) for name in ModelArgs.model_fields})
                          for model in self.models]

    @property
    def drain_timeout_s(self) -> float:
        if self.graceful_shutdown_timeout_s is not None:
            return self.graceful_shutdown_timeout_s
        return self.request_timeout_s + 10


def ray_accelerator_types() -> set[str]:
    from ray.util.accelerators import accelerators  # the names Ray's nodes advertise as `accelerator_type:<name>`

    return {value for name, value in vars(accelerators).items() if name.isupper() and isinstance(value, str)}


def shipped_app_args() -> AppArgs:
    """The args `make serve` runs the app with (serve_app/config.yaml), parsed as Serve's build_app parses them."""
    config = yaml.safe_load(Path(__file__).with_name("config.yaml").read_text())
    return AppArgs(**config["applications"][0]["args"])
