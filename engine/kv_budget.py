"""How many KV-cache blocks a replica gets: set outright, from a byte budget, or (on CUDA) from the memory left after
a forward pass at the largest step size, as vLLM's worker profiles it."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner, kv_bytes_per_block
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

CPU_DEFAULT_KV_BYTES = 2 << 30


def num_kv_blocks(config: EngineConfig, runner: ModelRunner) -> int:
    per_block = kv_bytes_per_block(runner.model.config, config.block_size, runner.dtype)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is not None:
        return max(2, config.kv_cache_memory // per_block)
    if runner.device.type == "cuda":
        return max(2, cuda_kv_budget(config, runner) // per_block)
    return max(2, CPU_DEFAULT_KV_BYTES // per_block)


def cuda_kv_budget(config: EngineConfig, runner: ModelRunner) -> int:
    """Free memory after a warm-up forward at the largest step size, times gpu_memory_utilization."""
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    blocks = -(-config.max_num_batched_tokens // config.block_size)
    runner.kv_cache = runner.allocate_kv_cache(blocks)
    warm = Sequence("warmup", [0] * config.max_num_batched_tokens, SamplingParams(max_tokens=1))
    warm.block_table = list(range(blocks))
    batch = ScheduledBatch()
    batch.add(warm, len(warm))
    runner.execute(batch)  # the logits are not needed, only the memory peak
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    runner.kv_cache = runner.allocate_kv_cache(1)
    torch.cuda.empty_cache()
    used_elsewhere = total - free
    return int(total * config.gpu_memory_utilization - used_elsewhere - activation_peak)
