"""Decode steps replayed from CUDA graphs, as nano-vllm's and vLLM's model runners do: one graph per batch-size
bucket, captured at start-up over persistent input buffers, so a decode step is a handful of copies and one launch
instead of about 40 kernel launches a layer from Python.

A graph holds the decoder up to its final norm; the LM head runs after the replay, eagerly, on the step's own rows,
as both of those runners compute logits outside the graph. Every graph's output stays allocated for its lifetime: as
logits, the 20 buckets up to 256 rows held 2,191 rows of the vocabulary (~635 of the 672 MiB the first H100 run's
graphs took, for a 152k vocabulary in bf16); as hidden states they hold 2,191 rows of the model's width (~6.7 MB).

A step of n sequences runs the smallest bucket b >= n; rows n..b are padding: slot -1 (the KV write skips it) and a
one-token context (the attention reads one valid slot and its output is discarded). The attention's split count is
fixed per bucket at capture (sized for the longest context the engine admits); each sequence's part size is worked
out inside the kernel from its own length, so one graph serves any lengths.

A step launched ahead (async scheduling) over the same sequences as the step it follows advances the buffers on the
device instead (`advance`): each row's position and context length one further, its slot read from its block table,
which changes only where a sequence took a new block; so the host builds no per-row list for it, as vLLM's persistent
batch (`InputBatch`) keeps the rows' state from step to step.

Where the device is not CUDA, `capture=False` runs the same buffers eagerly: how the tests check the buffer and
padding logic on CPU (with the Triton kernels under triton's interpreter).
"""
from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from engine.layers.attention import AttentionMetadata, DecodeBatch

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs (which is always a bucket)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, kv_layers, block_size: int, max_num_seqs: int,
                 max_model_len: int, num_splits, capture: bool = True, gemm_plan=None):
        """`num_splits(batch)`: the attention's split count for a bucket; `gemm_plan`: the linears' kernels
        (engine/gemm_plan.py), None: cuBLAS."""
        self.model = model
        self.block_size = block_size
        self.device = kv_cache.device
        self.buckets = batch_buckets(max_num_seqs)
        rows, width = self.buckets[-1], -(-max_model_len // block_size)
        long = dict(dtype=torch.long, device=self.device)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.slot_mapping = torch.full((rows,), -1, **long)
        self.block_tables = torch.zeros((rows, width), **long)
        self.context_lens = torch.ones(rows, **long)
        self.sample_indices = torch.arange(rows, **long)
        self.meta = {b: AttentionMetadata(kv_layers, self.slot_mapping[:b], DecodeBatch(
            self.block_tables[:b], self.context_lens[:b], block_size, None, num_splits(b)), [], None, kv_cache,
            triton=True) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output: the final norm's [b, hidden]
        self.memory_bytes = 0
        self.gemm_plan = gemm_plan
        self.num_advanced = 0  # steps whose inputs were advanced on the device rather than copied from the host
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest bucket first, all in one memory pool (each smaller graph reuses the largest one's memory)."""
        before = torch.cuda.memory_allocated(self.device)
        pool = None
        for b in tqdm(list(reversed(self.buckets)), desc="capturing decode CUDA graphs", unit="graph"):
            with self.gemm_plan.applied(b) if self.gemm_plan is not None else nullcontext():
                self._forward(b)  # the first call compiles the Triton kernels for this shape, outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[b] = self._forward(b)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_allocated(self.device) - before
        log.info("captured %d decode CUDA graphs (batches %s), %.0f MB", len(self.graphs), self.buckets,
                 self.memory_bytes / 1e6)

    def _forward(self, b: int) -> torch.Tensor:
        return self.model.model(self.input_ids[:b], self.positions[:b], self.meta[b])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step of n <= max_batch sequences -> logits [n, vocab]."""
        decode = meta.decode
        n, width = decode.size, decode.block_tables.shape[1]
        b = self.bucket(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(decode.block_tables, non_blocking=True)
        self.context_lens[:n].copy_(decode.context_lens, non_blocking=True)
        self.slot_mapping[n:b].fill_(-1)  # rows a larger step left behind are padding again
        self.context_lens[n:b].fill_(1)
        return self.replay(n)

    def advance(self, input_ids: torch.Tensor, new_blocks: tuple[torch.Tensor, ...] | None) -> None:
        """The inputs of the step after the one the buffers hold, over the same n sequences in the same order, each
        one token further: `input_ids` [n] on the device; `new_blocks` (rows, columns, block ids) the block-table
        entries sequences took since, or None. Padding rows stay as the step before left them; `replay(n)` runs it."""
        n = input_ids.shape[0]
        positions, block_size = self.positions[:n], self.block_size
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        positions += 1
        torch.add(positions, 1, out=self.context_lens[:n])
        if new_blocks is not None:
            rows, columns, blocks = new_blocks
            self.block_tables.index_put_((rows, columns), blocks)
        pages = self.block_tables[:n].gather(1, torch.div(positions, block_size, rounding_mode="floor").unsqueeze(1))
        torch.add(positions % block_size, pages.squeeze(1), alpha=block_size, out=self.slot_mapping[:n])
        self.num_advanced += 1

    def replay(self, n: int) -> torch.Tensor:
        """The bucket's graph over the buffers as they stand -> logits of their first n rows."""
        b = self.bucket(n)
        if b in self.graphs:
            self.graphs[b].replay()
            hidden = self.hidden[b]
        else:
            hidden = self._forward(b)
        return self.model.lm_head(hidden, self.sample_indices[:n])
