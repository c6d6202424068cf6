"""How many KV-cache blocks a replica gets: set outright, from a byte budget, or (on CUDA) from the memory left after
a forward pass at the largest step size, as vLLM's worker profiles it."""
from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner, kv_bytes_per_block
from engine.sampler import PROMPT_LOGPROB_ROWS
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

log = logging.getLogger(__name__)
CPU_DEFAULT_KV_BYTES = 2 << 30


@dataclass(frozen=True)
class DeviceMemoryAtStart:
    """The device's memory when the engine began, before its weights: what its gpu_memory_utilization share is
    counted from."""
    free: int
    total: int
    torch_reserved: int  # this process's caching allocator (an earlier engine's tensors in the same process)


def device_memory_at_start(config: EngineConfig, device: torch.device) -> DeviceMemoryAtStart | None:
    """On CUDA, where the pool is sized by profiling: the device's memory now, refused (as vLLM refuses it) when less
    is free than the engine's share, `gpu_memory_utilization` of the device's total."""
    if device.type != "cuda" or config.num_kv_blocks is not None or config.kv_cache_memory is not None:
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    share = config.gpu_memory_utilization * total
    if free < share:
        raise ValueError(f"gpu_memory_utilization {config.gpu_memory_utilization} asks for {share / 2**30:.2f} GiB of "
                         f"{device}, which has {free / 2**30:.2f} of {total / 2**30:.2f} GiB free; lower it (engines "
                         "sharing a GPU each take their own share) or free the device")
    return DeviceMemoryAtStart(free, total, torch.cuda.memory_reserved(device))


def num_kv_blocks(config: EngineConfig, runner: ModelRunner, at_start: DeviceMemoryAtStart | None = None) -> int:
    per_block = kv_bytes_per_block(runner.model.config, config.block_size, runner.kv_dtype)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        return max(2, config.kv_cache_memory // per_block)
    if at_start is not None:
        return max(2, cuda_kv_budget(config, runner, at_start) // per_block)
    return max(2, CPU_DEFAULT_KV_BYTES // per_block)


def kv_budget_bytes(utilization: float, at_start: DeviceMemoryAtStart, free_now: int, torch_reserved_now: int,
                    activation_peak: int) -> int:
    """The pool's bytes: the engine's share of the device less what it has taken since it began (its weights, the
    CUDA libraries' workspaces) and the peak of its costliest step. What it took is the fall in free memory (vLLM's
    reading), or, where another process freed memory meanwhile, at least what its own allocator holds more; another
    process allocating meanwhile makes the pool smaller, never larger, and memory other processes held before the
    engine began is not counted against its share."""
    taken = max(at_start.free - free_now, torch_reserved_now - at_start.torch_reserved)
    return int(utilization * at_start.total - taken - activation_peak)


def cuda_kv_budget(config: EngineConfig, runner: ModelRunner, at_start: DeviceMemoryAtStart) -> int:
    """The engine's share of the device after a warm-up step at the largest step size (`kv_budget_bytes`). The step
    is the costliest one a request can ask for: a whole chunk of prompt with logits at every position (prompt
    logprobs), then the sampler's fp32 work on the widest batch, both alive at the peak. CUDA graphs are captured
    after the pool is allocated and live in the headroom that gpu_memory_utilization leaves (their size is logged)."""
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    tokens = min(config.max_num_batched_tokens, getattr(runner.model.config, "max_position_embeddings", None) or 1 << 30)
    blocks = -(-tokens // config.block_size)
    runner.kv_cache = runner.allocate_kv_cache(blocks)
    warm = Sequence("warmup", [0] * tokens, SamplingParams(max_tokens=1, prompt_logprobs=0))
    warm.block_table = array("q", range(blocks))
    batch = ScheduledBatch()
    batch.add(warm, len(warm))
    step = runner.execute(batch)
    rows = max(sampled_rows(config), PROMPT_LOGPROB_ROWS)
    sampler_work = [torch.empty((rows, step.logits.shape[1]), dtype=torch.float32, device=device) for _ in range(3)]
    torch.cuda.synchronize(device)
    del step, sampler_work
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    runner.kv_cache = runner.allocate_kv_cache(1)
    torch.cuda.empty_cache()  # so what is free is what the pool can have, less the peak
    free, total = torch.cuda.mem_get_info(device)
    share = config.gpu_memory_utilization * total
    budget = kv_budget_bytes(config.gpu_memory_utilization, at_start, free, torch.cuda.memory_reserved(device),
                             activation_peak)
    log.info("KV budget: %.2f GiB, the engine's %.0f%% of %.1f GiB less %.2f GiB taken since it began (weights, "
             "workspaces) and %.2f GiB peak of the costliest step; %.2f GiB was in use when it began", budget / 2**30,
             100 * config.gpu_memory_utilization, total / 2**30, (share - budget - activation_peak) / 2**30,
             activation_peak / 2**30, (total - at_start.free) / 2**30)
    return budget


def sampled_rows(config: EngineConfig) -> int:
    """The most logits rows one step samples: every running sequence, with its drafts when speculating."""
    drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    return config.max_num_seqs * (1 + drafts)
