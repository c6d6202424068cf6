"""How many parts (flash-decoding's splits) each captured decode graph cuts a sequence's context into, timed on this
GPU at start-up.

The rule in `engine/kernels/triton/decode.py` splits only where a batch has fewer (sequence, KV head) pairs than the
GPU has SMs. Past that, more programs put more K/V loads in flight and shorten each program's chain of dependent
tiles, against a merge kernel and the partials' round trip; which wins depends on the GPU, the model's heads and the
context. On the H200 (2026-12-04) a batch-256 step read K/V at about half the bandwidth (17 us a layer at ~160 tokens
of context: 512 programs of three tiles each, one split). So, as `engine/gemm_plan.py` does for the linears, each
bucket's count is timed: the decode kernel at every candidate count, at a few context lengths, each as a graph of calls
over the pool's layers in turn (cold K/V, as a step reads them; engine/kernel_timing.py), and the graph is captured
with the count whose time is least on average relative to each context's fastest. Eager steps, and buckets of fewer than
MIN_ROWS sequences, keep the rule.
"""
from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.kernel_timing import time_calls
from engine.kernels.triton.decode import MAX_SPLITS, decode_attention

log = logging.getLogger(__name__)

CONTEXTS = (128, 1024, 4096)  # tokens of context a bucket is timed at (at most the engine's max_model_len)
MIN_ROWS = 64  # smaller buckets keep the rule, which splits them until their programs fill the SMs


@dataclass
class SplitPlan:
    rule: Callable[[int], int]  # a bucket's count where none was timed: the kernel's own rule
    chosen: dict[int, int] = field(default_factory=dict)  # bucket -> splits
    timings: list[dict] = field(default_factory=list)  # per bucket: us a call for each (splits, context), the choice

    def splits(self, bucket: int) -> int:
        return self.chosen.get(bucket, self.rule(bucket))

    @classmethod
    def measure(cls, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int, dtype: torch.dtype,
                buckets: list[int], max_model_len: int, rule: Callable[[int], int]) -> SplitPlan:
        """`kv_layers`: the pool's (K, V) per layer, each [kv_heads, num_blocks, block_size, head_dim]."""
        plan = cls(rule)
        contexts = sorted({min(c, max_model_len) for c in CONTEXTS})
        for bucket in (b for b in buckets if b >= MIN_ROWS):
            plan._choose(bucket, contexts, kv_layers, num_heads, dtype)
        return plan

    def _choose(self, bucket: int, contexts: list[int], kv_layers: list, num_heads: int, dtype: torch.dtype) -> None:
        candidates = sorted({1 << i for i in range(MAX_SPLITS.bit_length())} | {self.rule(bucket)})
        us: dict[tuple[int, int], float] = {}
        for context in contexts:
            query, tables, lens, out = decode_inputs(kv_layers[0][0], bucket, context, num_heads, dtype)
            scale = query.shape[-1] ** -0.5
            for splits in candidates:
                try:
                    us[splits, context] = time_calls(lambda kv: decode_attention(
                        query, kv[0], kv[1], tables, lens, scale, splits, out), kv_layers)
                except Exception as error:  # a compile or launch failure: that count is not a candidate
                    log.debug("%d splits skipped at batch %d, context %d: %s", splits, bucket, context, error)
        fastest = {c: min((t for (_, c2), t in us.items() if c2 == c), default=None) for c in contexts}
        scores = {s: statistics.mean(us[s, c] / fastest[c] for c in contexts)
                  for s in candidates if all((s, c) in us for c in contexts)}
        best = min(scores, key=lambda s: (scores[s], s), default=None)  # ties: fewer splits, less partial traffic
        if best is not None:
            self.chosen[bucket] = best
        self.timings.append({"rows": bucket, "rule": self.rule(bucket), "splits": self.splits(bucket),
                             "us": {f"{s}x{c}": round(t, 2) for (s, c), t in sorted(us.items())}})

    def summary(self) -> str:
        changed = {t["rows"]: t["splits"] for t in self.timings if t["splits"] != t["rule"]}
        return (f"{len(self.timings)} buckets timed; the rule's count kept for {len(self.timings) - len(changed)}, "
                f"changed for {changed or 'none'}")


def decode_inputs(k_cache: torch.Tensor, batch: int, context: int, num_heads: int, dtype: torch.dtype) -> tuple:
    """A decode batch over the pool: `batch` sequences of `context` tokens on distinct blocks (wrapping where the pool
    holds fewer), a random query, an output buffer."""
    _, num_blocks, block_size, head_dim = k_cache.shape
    width = -(-context // block_size)
    device = k_cache.device
    tables = (torch.arange(batch * width, device=device) % num_blocks).view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.long, device=device)
    query = torch.randn(batch, num_heads, head_dim, device=device).to(dtype)
    return query, tables, lens, torch.empty_like(query)
