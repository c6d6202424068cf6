"""EngineStats: what an engine core reports about itself after every step, one typed struct from the core to the
metrics, the replica's health and autoscaling signals, the tests and the benchmarks. Torch-free: the ingress and the
replica read it too, and it travels in the core process's messages as msgpack."""
from __future__ import annotations

import msgspec


class EngineStats(msgspec.Struct, kw_only=True):
    # now
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    consecutive_failed_steps: int = 0
    resident_bytes: int = 0  # of the process the engine runs in
    # running totals since the engine started
    num_steps: int = 0
    num_failed_steps: int = 0
    prompt_tokens: int = 0  # computed, not read from the prefix cache
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps_ahead: int = 0  # launched before the step before them was read (async scheduling)
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # found: in cached blocks, or in a tail block copied
    prefix_cache_evictions: int = 0
    lora_loads: int = 0  # lora_root adapters read and installed, each time again after being dropped
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    metrics_share_of_step: float = 0.0  # time spent flushing metrics, of the time spent in steps
    step_seconds: dict[str, float] = {}  # by phase of the step (step_stats.PHASES)
    gc_collections: dict[int, int] = {}  # by generation
    gc_pause_seconds: dict[int, float] = {}
    # set by the loop that runs the engine (core_inline.InlineCore and its ThreadCore, core_process.CoreLoop)
    loop_threads: int = 0  # torch's intra-op threads in the step loop
    core_pid: int = 0

    @property
    def kv_usage(self) -> float:
        """The share of KV blocks in use, 0 before the pool exists."""
        return 1 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def idle(self) -> bool:
        """Nothing running or waiting and every KV block free: what every test's leak check asks."""
        return self.num_running == 0 and self.num_waiting == 0 and self.kv_blocks_free == self.kv_blocks_total
