"""Which code runs attention, chosen once at start-up from the config and the device; a combination that cannot run
is refused here, with the setting named, never mid-step."""
from __future__ import annotations

import os

from engine.config import EngineConfig


def choose_attention_backend(config: EngineConfig, device_type: str, capability: tuple[int, int] | None = None,
                             shaped_scores: str | None = None) -> str:
    """'cpp' (the fused CPU kernels, where they build; 'auto' on CPU), 'torch' (the reference path) or 'triton'
    ('auto' on CUDA; on CPU only under TRITON_INTERPRET=1, as the tests run it). `capability`: the CUDA device's;
    `shaped_scores`: what the model's attention does to its scores (a sliding window, soft-capping), which the C++
    kernels do not compute: on CPU `auto` is then the torch path."""
    backend = config.attention_backend
    if shaped_scores is not None:
        if backend == "cpp":
            raise ValueError(f"attention_backend cpp cannot compute this model's {shaped_scores}; use auto, torch or "
                             "triton (CUDA)")
        if backend == "auto" and device_type != "cuda":
            return "torch"
    if device_type == "cuda" and config.kv_cache_dtype in ("fp8", "fp8_e4m3") and capability is not None \
            and capability < (8, 9):
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype} (e4m3) needs compute capability 8.9 or later, which "
                         f"triton compiles e4m3 for; this GPU is {capability[0]}.{capability[1]}: use fp8_e5m2")
    if device_type == "cuda":
        if backend == "cpp":
            raise ValueError("attention_backend cpp is a CPU kernel; on CUDA use triton (auto) or torch")
        if config.quantization == "gguf":
            raise ValueError("quantization gguf runs on CPU kernels only; on CUDA use dense weights, nf4 or int8")
        if config.compile:
            raise ValueError("compile is for CPU steps; on CUDA decode steps run in CUDA graphs instead")
        backend = "triton" if backend == "auto" else backend
    elif backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend triton needs a CUDA device (or TRITON_INTERPRET=1, as the tests run it)")
    if backend == "triton" and (config.block_size < 16 or config.block_size & (config.block_size - 1)):
        raise ValueError(f"attention_backend triton needs block_size a power of two, 16 or more, not {config.block_size}")
    return "cpp" if backend == "auto" else backend
