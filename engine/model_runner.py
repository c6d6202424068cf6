"""One forward per step over a flat, unpadded batch; logits only where a sequence samples next."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from engine.cuda_graphs import DecodeGraphs
from engine.host_memory import ask_huge_pages
from engine.layers.attention import AttentionMetadata, DecodeBatch, PrefillBatch, PrefillChunk
from engine.models import Model
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.step_stats import PhaseTimer

log = logging.getLogger(__name__)


@dataclass
class PromptLogits:
    """Logits predicting prompt tokens first_position, first_position + 1, ... of `seq`."""

    seq: Sequence
    first_position: int
    logits: torch.Tensor


@dataclass
class StepLogits:
    """One step's logits: `rows[i]` consecutive rows for `seqs[i]` (1, or 1 + its drafts: the rows that verify them
    and the bonus), and the prompt positions of sequences that asked for prompt logprobs."""

    seqs: list[Sequence]
    logits: torch.Tensor
    rows: list[int]
    prompt: list[PromptLogits]


def kv_geometry(hf_config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return hf_config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    layers, kv_heads, head_dim = kv_geometry(hf_config)
    return layers * 2 * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model: Model, block_size: int, num_blocks: int, dtype: torch.dtype, device: torch.device,
                 decode_kernel=None, write_kv=None, phases: PhaseTimer | None = None, triton: bool = False,
                 prefill_kernel=None):
        self.model = model
        self.triton = triton  # attention on the Triton kernels (engine/layers/triton_attention.py)
        self.num_splits_for = None  # the decode kernel's split rule, where Triton runs (triton is imported only there)
        if triton:
            from engine.kernels.triton.decode import num_splits_for

            self.num_splits_for = num_splits_for
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.graphs: DecodeGraphs | None = None  # decode steps from CUDA graphs; see capture_graphs
        self.phases = phases or PhaseTimer()  # where the step's prepare and forward seconds add up
        self.decode_kernel = decode_kernel
        self.write_kv = write_kv
        self.prefill_kernel = prefill_kernel
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.kv_cache = self.allocate_kv_cache(num_blocks)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, pool: torch.Tensor) -> None:
        self._kv_cache = pool
        self.kv_layers = [(layer[0], layer[1]) for layer in pool]  # views split once, not in every layer of every step

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        layers, kv_heads, head_dim = kv_geometry(self.model.config)
        shape = (layers, 2, kv_heads, num_blocks, self.block_size, head_dim)
        pool = torch.empty(shape, dtype=self.dtype, device=self.device)
        ask_huge_pages(pool)  # before the zeros touch it: decode attention reads blocks scattered over all of it
        return pool.zero_()

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> DecodeGraphs:
        """Decode steps of up to max_num_seqs sequences replay CUDA graphs from now on (capture=False: the same
        buffers, run eagerly; tests on CPU). Call after the KV pool is allocated: the graphs hold its address."""
        kv_heads = self.kv_cache.shape[2]
        self.graphs = DecodeGraphs(self.model, self.kv_cache, self.kv_layers, self.block_size, max_num_seqs,
                                   max_model_len, lambda b: self.num_splits_for(b, kv_heads, max_model_len, self.num_sms),
                                   capture)
        return self.graphs

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[3]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        """Run one step: the logits of every sequence that samples now (its last real token and its drafts), and of
        the prompt positions computed now for sequences that asked for prompt logprobs."""
        with self.phases("prepare"):
            if batch.block_copies:
                self._copy_blocks(batch.block_copies)
            inputs = self._prepare(batch)
        with self.phases("forward"):
            return self._forward(*inputs)

    def _prepare(self, batch: ScheduledBatch) -> tuple:
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)  # decodes first, stable
        seqs = [batch.seqs[i] for i in order]
        num_new_tokens = [batch.num_new_tokens[i] for i in order]
        input_ids, positions, slots, sample_indices, sampling_seqs, rows = [], [], [], [], [], []
        prompt_indices, prompt_spans = [], []
        for seq, num_new, drafts in zip(seqs, num_new_tokens, (batch.draft_token_ids[i] for i in order)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            if seq.params.prompt_logprobs is not None:  # positions predicting a prompt token (not the first output)
                count = max(0, min(end, seq.num_prompt_tokens - 1) - start)
                prompt_spans.append((seq, start + 1, len(prompt_indices), count))
                prompt_indices.extend(range(len(input_ids), len(input_ids) + count))
            input_ids.extend(seq.token_ids[start : end - len(drafts)] + drafts)
            positions.extend(range(start, end))
            slots.extend(self._slots(seq.block_table, start, end))
            if end - len(drafts) == len(seq):
                sample_indices.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
                sampling_seqs.append(seq)
                rows.append(1 + len(drafts))
        meta = self._metadata(seqs, num_new_tokens, slots)
        model_inputs = (self._tensor(input_ids), self._tensor(positions), meta, self._tensor(sample_indices + prompt_indices))
        return model_inputs, len(sample_indices), sampling_seqs, rows, prompt_spans

    def _forward(self, model_inputs: tuple, num_sampled: int, sampling_seqs: list[Sequence], rows: list[int],
                 prompt_spans: list) -> StepLogits:
        input_ids, positions, meta, logits_indices = model_inputs
        if self._replays(meta, logits_indices):
            logits = self.graphs.run(input_ids, positions, meta)
        else:
            logits = self.model(*model_inputs)
        sampled, prompt = logits[:num_sampled], logits[num_sampled:]
        return StepLogits(sampling_seqs, sampled, rows, [PromptLogits(seq, first, prompt[offset : offset + count])
                                                         for seq, first, offset, count in prompt_spans if count])

    def _replays(self, meta: AttentionMetadata, logits_indices: torch.Tensor) -> bool:
        """Whether a captured graph runs this step: decodes only, each sampling one row, within the graphs' batch."""
        graphs, decode = self.graphs, meta.decode
        return (graphs is not None and decode is not None and meta.prefill_batch is None and not meta.prefills
                and logits_indices.shape[0] == decode.size <= graphs.max_batch
                and decode.block_tables.shape[1] <= graphs.block_tables.shape[1])

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Every layer's K and V of each source block into its target block."""
        sources, targets = (self._tensor(list(ids)) for ids in zip(*copies))
        self.kv_cache.index_copy_(3, targets, self.kv_cache.index_select(3, sources))

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _metadata(self, seqs: list[Sequence], num_new_tokens: list[int], slots: list[int]) -> AttentionMetadata:
        num_decodes = sum(1 for n in num_new_tokens if n == 1)
        decode = self._decode_batch(seqs[:num_decodes]) if num_decodes else None
        if self.triton:
            return AttentionMetadata(self.kv_layers, self._tensor(slots), decode, [], None, self.kv_cache,
                                     self._prefill_batch(seqs[num_decodes:], num_new_tokens[num_decodes:]), True)
        prefills, start = [], num_decodes
        for seq, num_new in zip(seqs[num_decodes:], num_new_tokens[num_decodes:]):
            context_len = seq.num_computed_tokens + num_new
            table = self._tensor(seq.block_table[: -(-context_len // self.block_size)])
            prefills.append(PrefillChunk(start, start + num_new, context_len, table))
            start += num_new
        return AttentionMetadata(self.kv_layers, self._tensor(slots), decode, prefills, self.write_kv, self.kv_cache,
                                 prefill_kernel=self.prefill_kernel)

    def _prefill_batch(self, seqs: list[Sequence], num_new_tokens: list[int]) -> PrefillBatch | None:
        if not seqs:
            return None
        starts = [0]
        for num_new in num_new_tokens:
            starts.append(starts[-1] + num_new)
        context_lens = [seq.num_computed_tokens + num_new for seq, num_new in zip(seqs, num_new_tokens)]
        width = max(-(-n // self.block_size) for n in context_lens)
        tables = _padded([seq.block_table[:width] for seq in seqs], width)
        return PrefillBatch(self._tensor(starts), self._tensor(context_lens), self._tensor(tables), max(num_new_tokens))

    def _decode_batch(self, seqs: list[Sequence]) -> DecodeBatch:
        width = max(len(seq.block_table) for seq in seqs)
        tables = self._tensor(_padded([seq.block_table for seq in seqs], width))
        lens = [seq.num_computed_tokens + 1 for seq in seqs]
        splits = 1
        if self.num_splits_for is not None:
            splits = self.num_splits_for(len(seqs), self.kv_cache.shape[2], max(lens), self.num_sms)
        return DecodeBatch(tables, self._tensor(lens), self.block_size, self.decode_kernel, splits)

    def _tensor(self, values) -> torch.Tensor:
        """Host values to the device without waiting for it: through pinned memory on CUDA."""
        host = torch.tensor(values, dtype=torch.long, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)


def _padded(tables: list[list[int]], width: int) -> list[list[int]]:
    """Block tables as rows of one width, padded with block 0 (the kernels read no further than each context)."""
    return [table + [0] * (width - len(table)) for table in tables]
