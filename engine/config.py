"""EngineConfig: every knob of the engine in one typed place."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# what a model's generation_config.json may default for requests, by transformers' names (vLLM's list)
SamplingDefault = Literal["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"]
# a name under lora_root: one path component, no leading dot, so no request reaches outside the root
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class SpeculativeConfig(BaseModel):
    """N-gram (prompt lookup) speculative decoding; the names follow vLLM's `speculative_config`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(default=4, ge=1, le=16, description="k: drafts verified per step and sequence")
    prompt_lookup_max: int = Field(default=4, ge=1, description="longest suffix looked up in the context")
    prompt_lookup_min: int = Field(default=2, ge=1, description="shortest suffix that may propose")
    lookup_window: int = Field(default=4096, ge=2, description="how many of the latest tokens are searched")
    disable_by_batch_size: int = Field(default=4, ge=1, description=(
        "no drafts while more sequences run than this: a large batch is compute-bound, so verifying costs more "
        "than it saves"))
    weigh_cost: bool = Field(default=True, description=(
        "draft only as much as pays by the measured time of a step's rows; False: whenever a match exists"))
    min_acceptance: float = Field(default=0.2, ge=0, le=1, description="a sequence's acceptance rate below which it pauses")
    pause_steps: int = Field(default=16, ge=0, description="steps a low-acceptance sequence goes without drafts")

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class LoRAModule(BaseModel):
    """A LoRA adapter served beside the base model, as vLLM's `--lora-modules name=path`: a PEFT directory
    (adapter_config.json, adapter_model.safetensors) whose adapter a request chooses by `name`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256, description="what requests give as their model")
    path: str = Field(min_length=1, description="the adapter's PEFT directory")


class EngineConfig(BaseModel):
    # no protected namespace: `model_impl` is vLLM's name, and pydantic before 2.10 warned that it starts with model_
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = DEFAULT_MODEL
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    quantization: Literal["gguf", "nf4", "int8"] | None = Field(default=None, description=(
        "gguf: the embedded model's (or a .gguf file's) Q4_0/Q4_1/Q8_0 blocks as stored, read by their own kernel for "
        "small batches; nf4/int8: bitsandbytes; None: dense weights in `dtype`"))
    device: str = "auto"
    model_impl: Literal["auto", "native", "hf"] = Field(
        default="auto", description="the engine's own Llama-family model where it fits the checkpoint (auto), or transformers' code")
    num_threads: int | None = Field(default=None, ge=1, description="torch threads; default: all cores of the node")

    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=2)
    kv_cache_memory: int | None = Field(default=None, ge=1, description="KV pool bytes when num_kv_blocks is unset")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1, description=(
        "on CUDA, the part of the device's total this engine may take (weights, activations, KV pool), as vLLM "
        "reads it; engines sharing a GPU each take their own"))

    max_num_seqs: int = Field(default=128, ge=1)
    max_num_batched_tokens: int = Field(default=1024, ge=1)
    long_prefill_token_threshold: int | None = Field(default=None, ge=1, description=(
        "the most prompt tokens one request computes in a step (vLLM's flag): a long prompt is spread over more, "
        "shorter steps, so the streams decoding beside it wait less for their next token; None: up to "
        "max_num_batched_tokens"))
    scheduling_policy: Literal["fcfs", "priority"] = Field(default="fcfs", description=(
        "fcfs: requests are served in arrival order and a request's priority must be 0; priority: by the request's "
        "priority (lower first), then arrival, and preemption takes the last in that order (vLLM's flag)"))
    max_model_len: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(default="auto", description=(
        "the KV cache's element type (vLLM's flag). auto: the model's dtype; fp8 (e4m3, as in vLLM), fp8_e4m3, "
        "fp8_e5m2: one byte a value, unscaled (vLLM's scale 1.0 where a checkpoint brings none), so a memory budget "
        "holds 2x the blocks of bf16. e4m3 keeps a mantissa bit more, e5m2 a wider range; on CUDA e4m3 needs compute "
        "capability 8.9 (L4, H100), e5m2 runs from 8.0; on CPU the C++ kernels widen them as they read "
        "(prompts: on AMX tiles, else SDPA over the widened context)"))
    attention_backend: Literal["auto", "torch", "cpp", "triton"] = Field(default="auto", description=(
        "auto: the paged Triton kernels on CUDA, the C++ decode kernel on CPU where it builds; torch: the padded "
        "reference path"))
    compile: bool = Field(default=False, description=(
        "torch.compile (inductor) the native model's steps, but the one-call GGUF decode; compiled in the warm-up, "
        "cached on disk under the engine's cache directory. Off: measured at 0.97-1.01x the eager step, for a "
        "40-80 s first start (BENCHMARKS.md)"))
    enforce_eager: bool = Field(default=False, description=(
        "on CUDA, decode steps replay CUDA graphs captured at start-up for batch buckets up to max_num_seqs (native "
        "models); True: every step runs eagerly (vLLM's flag)"))
    gemm_tuning: bool = Field(default=True, description=(
        "with CUDA graphs in bf16/fp16: at start-up, time each decoder linear's shape at every graph bucket of 64 "
        "rows and more on cuBLAS and on the Triton tilings (engine/gemm_plan.py), and capture each graph on the "
        "fastest; False: cuBLAS throughout"))
    split_tuning: bool = Field(default=True, description=(
        "with CUDA graphs on the Triton attention: at start-up, time the decode kernel at each split count "
        "(flash-decoding's parts of a sequence's context) for every graph bucket at a few context lengths, and capture "
        "each graph on the count fastest overall (engine/split_plan.py); False: the kernel's rule (split only where "
        "a batch's (sequence, KV head) pairs are fewer than the SMs)"))
    async_scheduling: bool = Field(default=False, description=(
        "launch the next decode step before reading this one's tokens, so the host's scheduling and input "
        "preparation overlap the GPU's forward (vLLM's flag); for decode steps whose rows draw from their logits "
        "alone (greedy or sampled; no logprobs, penalties, bias or grammar), others run as before. 1.2-1.8x a "
        "decode step on an H200 (BENCHMARKS.md); off until its GPU tests pass there"))
    max_waiting: int | None = Field(default=None, ge=1, description="bound on queued requests; None is unbounded")
    default_max_tokens: int | None = Field(default=None, ge=1, description="when a request gives none; None: the rest of the context")
    max_tokens_limit: int | None = Field(default=None, ge=1, description="cap on max_tokens, given or default; over it is refused")

    # liveness: the replica's health check fails on either, so Serve replaces a broken engine
    max_consecutive_failed_steps: int = Field(default=3, ge=1, description="failed steps in a row before unhealthy")
    step_timeout_s: float = Field(default=120.0, gt=0, description="one step running longer than this is a hung engine")
    tokenizer: str | None = Field(default=None, description=(
        "vLLM's --tokenizer: a Hugging Face id or local path whose tokenizer (and chat template) the engine uses in "
        "place of the model's: for a checkpoint shipped without one; None: the model's"))
    trust_remote_code: bool = False
    generation_config: Literal["auto", "vllm"] = Field(default="auto", description=(
        "vLLM's --generation-config: auto, the model's generation_config.json gives the defaults of temperature, "
        "top_p, top_k, min_p, repetition_penalty and max_tokens (its max_new_tokens) to requests that leave them "
        "unset, as its authors recommend; vllm, the neutral defaults (engine/sampling_defaults.py)"))
    override_generation_config: dict[SamplingDefault, float] = Field(default_factory=dict, description=(
        "vLLM's --override-generation-config: defaults over the generation config's, by its names, e.g. "
        "{temperature: 0.6, max_new_tokens: 512}"))
    chat_template: str | None = Field(default=None, description=(
        "vLLM's --chat-template: the Jinja template chat requests render with in place of the tokenizer's (a model "
        "without one serves no chat), given as its text or as the path of a file holding it; a path is read when the "
        "config is made, so the text travels with the config to every replica"))
    sanitize_control_tokens: bool = Field(default=True, description=(
        "a control token (a special token, or an added one the chat template writes, such as <|im_start|>) inside a "
        "chat's messages, tools or documents is encoded as the text it spells, so a client's or a third party's "
        "text cannot open a turn of another role; false: encoded as the token, as vLLM does"))
    engine_process: bool = Field(default=False, description=(
        "AsyncLLMEngine and LLM run the core (scheduler, model, sampler) in a child process with its own interpreter "
        "lock, as vLLM's v1 does; False: in the caller's process (AsyncLLMEngine on a thread of its own, LLM on the "
        "calling thread)"))
    speculative: SpeculativeConfig | None = Field(default=None, description="n-gram speculative decoding; None: off")
    lora_modules: tuple[LoRAModule, ...] = Field(default=(), description=(
        "LoRA adapters loaded at start, each chosen per request by name; requests of different adapters and of the "
        "base model share a batch (native Llama-family models only)"))
    max_lora_rank: int = Field(default=64, ge=1, description="the largest adapter rank accepted (vLLM's flag)")
    lora_root: str | None = Field(default=None, description=(
        "a directory of PEFT adapters, one per subdirectory: a request naming one that lora_modules does not is served "
        "by loading it on first use (Ray Serve LLM's dynamic LoRA loading, from a local or mounted path)"))
    max_loras: int = Field(default=8, ge=1, description=(
        "adapters from lora_root kept loaded; past it the least recently used one that no request runs is dropped"))

    @field_validator("chat_template")
    @classmethod
    def _read_chat_template(cls, value: str | None) -> str | None:
        return None if value is None else read_chat_template(value)

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.quantization == "gguf" and not (self.model == DEFAULT_MODEL or self.model.endswith(".gguf")):
            raise ValueError(f"quantization gguf needs the embedded model or a local .gguf file, not {self.model!r}")
        names = self.lora_module_names
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: each adapter needs a name of its own, got {names}")
        return self

    def lora_path(self, name: str) -> str | None:
        """Where adapter `name` is read from: lora_modules' path, else its directory under lora_root if that holds
        an adapter; None where this engine has no such adapter."""
        for module in self.lora_modules:
            if module.name == name:
                return module.path
        if self.lora_root is None or not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            return None
        directory = Path(self.lora_root) / name
        return str(directory) if (directory / "adapter_config.json").is_file() else None

    @property
    def lora_module_names(self) -> list[str]:
        """The adapters loaded at start (lora_modules), by name."""
        return [module.name for module in self.lora_modules]

    @property
    def serves_lora(self) -> bool:
        return bool(self.lora_modules) or self.lora_root is not None

    def resolved_num_threads(self) -> int:
        """Cores this process may run on (affinity and cpusets included, unlike os.cpu_count())."""
        if self.num_threads:
            return self.num_threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def read_chat_template(value: str) -> str:
    """A chat template's text: `value` itself where it holds a brace or a newline, as vLLM tells a template from a
    path, else the file it names. The text is parsed, so a broken template stops the start, not every chat."""
    text = value
    if not any(c in value for c in "{}\n"):
        try:
            text = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat_template: {value!r} reads as a path (no braces or newlines), and it cannot be "
                             f"read: {type(exc).__name__}: {exc}") from None
    if "{{" not in text and "{%" not in text:
        raise ValueError("chat_template: the template has no Jinja tags ({{ }} or {% %}), so it cannot render messages")
    from jinja2 import TemplateSyntaxError  # the validator's alone: most configs give no template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # transformers renders in this sandbox, with loop controls
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: not a valid Jinja template: {exc.message} (line {exc.lineno})") from None
    return text
