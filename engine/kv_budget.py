"""How many KV-cache blocks a replica gets: set outright, from a byte budget, or (on CUDA) from the memory left after
a forward pass at the largest step size, as vLLM's worker profiles it."""
from __future__ import annotations

import logging
from array import array

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner, kv_bytes_per_block
from engine.sampler import PROMPT_LOGPROB_ROWS
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

log = logging.getLogger(__name__)
CPU_DEFAULT_KV_BYTES = 2 << 30


def num_kv_blocks(config: EngineConfig, runner: ModelRunner) -> int:
    per_block = kv_bytes_per_block(runner.model.config, config.block_size, runner.kv_dtype)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        return max(2, config.kv_cache_memory // per_block)
    if runner.device.type == "cuda":
        return max(2, cuda_kv_budget(config, runner) // per_block)
    return max(2, CPU_DEFAULT_KV_BYTES // per_block)


def cuda_kv_budget(config: EngineConfig, runner: ModelRunner) -> int:
    """Free memory after a warm-up step at the largest step size, times gpu_memory_utilization. The step is the
    costliest one a request can ask for: a whole chunk of prompt with logits at every position (prompt logprobs),
    then the sampler's fp32 work on the widest batch, both alive at the peak. CUDA graphs are captured after the
    pool is allocated and live in the headroom that gpu_memory_utilization leaves (their size is logged)."""
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
    used_elsewhere = total - free  # weights, the CUDA context, other processes
    log.info("KV budget: %.2f GiB in use before the pool, %.2f GiB peak of the costliest step, %.0f%% of %.1f GiB",
             used_elsewhere / 2**30, activation_peak / 2**30, 100 * config.gpu_memory_utilization, total / 2**30)
    return int(total * config.gpu_memory_utilization - used_elsewhere - activation_peak)


def sampled_rows(config: EngineConfig) -> int:
    """The most logits rows one step samples: every running sequence, with its drafts when speculating."""
    drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    return config.max_num_seqs * (1 + drafts)
