"""One forward per step over a flat, unpadded batch; logits only where a sequence samples next."""
from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from engine.cuda_graphs import DecodeGraphs, batch_buckets
from engine.host_memory import ask_huge_pages, to_device
from engine.layers.attention import AttentionMetadata, DecodeBatch, PrefillBatch, PrefillChunk
from engine.layers.kv_cache_dtype import raw
from engine.layers.linear import Linear
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.step_stats import PhaseTimer

if TYPE_CHECKING:
    from engine.gemm_plan import GemmPlan
    from engine.layers.lora import LoRAStep
    from engine.models import Model
    from engine.split_plan import SplitPlan

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
    and the bonus), the prompt positions of sequences that asked for prompt logprobs, and the hidden states of
    embedding requests whose prompt ends in this step."""

    seqs: list[Sequence]
    logits: torch.Tensor
    rows: list[int]
    prompt: list[PromptLogits]
    pooled_seqs: list[Sequence] = field(default_factory=list)  # embedding requests that end now
    pooled: torch.Tensor | None = None  # [len(pooled_seqs), hidden]: each one's last prompt token's final hidden state


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
                 prefill_kernel=None, kv_dtype: torch.dtype | None = None):
        self.model = model
        self.triton = triton  # attention on the Triton kernels (engine/layers/triton_attention.py)
        self.num_splits_for = None  # the decode kernel's split rule, where Triton runs (triton is imported only there)
        if triton:
            from engine.kernels.triton.decode import num_splits_for

            self.num_splits_for = num_splits_for
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.graphs: DecodeGraphs | None = None  # decode steps from CUDA graphs; see capture_graphs
        self.graph_rows: list[Sequence] | None = None  # the sequences whose rows the graphs' buffers hold, in order
        self.split_plan: SplitPlan | None = None  # the graphs' decode attention split counts, where timed
        self.lora_step: LoRAStep | None = getattr(model, "lora_step", None)  # which rows run which LoRA adapter
        self.phases = phases or PhaseTimer()  # where the step's prepare and forward seconds add up
        self.decode_kernel = decode_kernel
        self.write_kv = write_kv
        self.prefill_kernel = prefill_kernel
        self.block_size = block_size
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the KV pool's element type (kv_cache_dtype): the model's, or fp8
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
        pool = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        ask_huge_pages(pool)  # before the zeros touch it: decode attention reads blocks scattered over all of it
        return pool.zero_()

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True,
                       gemm_tuning: bool = False, split_tuning: bool = False) -> DecodeGraphs:
        """Decode steps of up to max_num_seqs sequences replay CUDA graphs from now on (capture=False: the same
        buffers, run eagerly; tests on CPU). Call after the KV pool is allocated: the graphs hold its address.
        `gemm_tuning`: the layers' linears take the Triton tiling that times faster than cuBLAS, bucket by bucket;
        `split_tuning`: the decode attention's split count that times fastest, bucket by bucket."""
        kv_heads, buckets = self.kv_cache.shape[2], batch_buckets(max_num_seqs)

        def rule(bucket: int) -> int:
            return self.num_splits_for(bucket, kv_heads, max_model_len, self.num_sms)

        plan = self._gemm_plan(buckets) if gemm_tuning and capture else None
        if split_tuning and capture:
            self.split_plan = self._split_plan(buckets, max_model_len, rule)
        splits = self.split_plan.splits if self.split_plan is not None else rule
        self.graphs = DecodeGraphs(self.model, self.kv_cache, self.kv_layers, self.block_size, max_num_seqs,
                                   max_model_len, splits, capture, plan)
        return self.graphs

    def _split_plan(self, buckets: list[int], max_model_len: int, rule) -> SplitPlan:
        from engine.split_plan import SplitPlan  # imports triton: only where it runs

        started = time.perf_counter()
        plan = SplitPlan.measure(self.kv_layers, self.model.config.num_attention_heads, self.dtype, buckets,
                                 max_model_len, rule)
        log.info("decode attention's splits timed in %.1f s: %s", time.perf_counter() - started, plan.summary())
        return plan

    def _gemm_plan(self, buckets: list[int]) -> GemmPlan | None:
        from engine.gemm_plan import GemmPlan, plannable  # imports triton: only where it runs
        from engine.models.llama import MLP

        layers = self.model.model.layers
        linears = [m for m in layers.modules() if isinstance(m, Linear) and plannable(m)]
        if not linears:
            return None
        # gate/up projections that may write the MLP's activation: not under LoRA, which adds to their own output
        mlps = [m for m in layers.modules() if isinstance(m, MLP)]
        gated = [m.gate_up_proj for m in mlps if m.gate_up_proj.lora is None and any(m.gate_up_proj is x for x in linears)]
        started = time.perf_counter()
        plan = GemmPlan.measure(linears, buckets, gated, mlps[0].activation if gated else None)
        torch.cuda.empty_cache()  # the timed weight copies
        log.info("linear kernels timed in %.1f s: %s", time.perf_counter() - started, plan.summary())
        return plan

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[3]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        """Run one step: the logits of every sequence that samples now (its last real token and its drafts), of
        the prompt positions computed now for sequences that asked for prompt logprobs, and the last hidden state of
        embedding requests whose prompt ends now."""
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
        rows = _StepRows()
        for seq, num_new, drafts in zip(seqs, num_new_tokens, (batch.draft_token_ids[i] for i in order)):
            rows.add(seq, num_new, drafts, self.block_size)
        num_decodes = sum(1 for n in num_new_tokens if n == 1)
        host = [rows.input_ids, rows.positions, rows.sample_indices + rows.prompt_indices, rows.slots, rows.pool_indices]
        decode_lens = [seq.num_computed_tokens + 1 for seq in seqs[:num_decodes]]
        host += self._decode_lists(seqs[:num_decodes], decode_lens) if num_decodes else []
        host += self._prefill_lists(seqs[num_decodes:], num_new_tokens[num_decodes:])
        device = iter(self._upload(host))
        self._set_lora_rows(seqs, num_new_tokens)
        input_ids, positions, logits_indices, slots, pool_indices = (next(device) for _ in range(5))
        decode = self._decode_batch(num_decodes, max(decode_lens), device) if num_decodes else None
        meta = self._metadata(seqs[num_decodes:], num_new_tokens[num_decodes:], num_decodes, slots, decode, device)
        return (input_ids, positions, meta, logits_indices), len(rows.sample_indices), rows.sampling_seqs, rows.rows, \
            rows.prompt_spans, rows.pooled_seqs, pool_indices

    @torch.inference_mode()
    def execute_ahead(self, seqs: list[Sequence], input_ids: torch.Tensor, follows: list[Sequence] | None = None,
                      grown: list[tuple[int, int]] = ()) -> StepLogits:
        """A decode step one token past what each sequence holds (async scheduling): row i's token is input_ids[i],
        on the device (the step before's sampled ids, not yet read by the host), at position len(seqs[i]).
        `follows`: the step before's sequences; where they are these, in this order, and the graphs' buffers hold
        their rows, the buffers advance on the device. `grown`: (row, count) for each sequence that took `count`
        new blocks for this step."""
        if follows is not None and follows is self.graph_rows and len(seqs) == len(follows):
            return self._advance_graph_rows(seqs, input_ids, grown)
        with self.phases("prepare"):
            positions = [len(seq) for seq in seqs]
            slots = [_slot(seq.block_table, p, self.block_size) for seq, p in zip(seqs, positions)]
            host = [positions, list(range(len(seqs))), slots, *self._decode_lists(seqs, [p + 1 for p in positions])]
            device = iter(self._upload(host))
            self._set_lora_rows(seqs, [1] * len(seqs))
            positions_on_device, logits_indices, slots_on_device = (next(device) for _ in range(3))
            decode = self._decode_batch(len(seqs), max(positions) + 1, device)
            meta = self._metadata([], [], len(seqs), slots_on_device, decode, device)
        with self.phases("forward"):
            return self._forward((input_ids, positions_on_device, meta, logits_indices), len(seqs), seqs,
                                 [1] * len(seqs), [])

    def _advance_graph_rows(self, seqs: list[Sequence], input_ids: torch.Tensor,
                            grown: list[tuple[int, int]]) -> StepLogits:
        """The step ahead from the graphs' buffers, advanced on the device: no per-row host work but the block-table
        entries taken since (about one sequence in block_size a step). The step before replayed a graph, so these
        rows run no LoRA adapter."""
        self.graph_rows = None  # until the buffers hold this step's rows
        with self.phases("prepare"):
            new_blocks = None
            if grown:
                rows, columns, blocks = array("q"), array("q"), array("q")
                for row, count in grown:
                    table = seqs[row].block_table
                    rows.extend([row] * count)
                    columns.extend(range(len(table) - count, len(table)))
                    blocks.extend(table[len(table) - count:])
                new_blocks = tuple(self._upload([rows, columns, blocks]))
            self.graphs.advance(input_ids, new_blocks)
        with self.phases("forward"):
            logits = self.graphs.replay(len(seqs))
        self.graph_rows = seqs
        return StepLogits(seqs, logits, [1] * len(seqs), [])

    def _forward(self, model_inputs: tuple, num_sampled: int, sampling_seqs: list[Sequence], rows: list[int],
                 prompt_spans: list, pooled_seqs: list[Sequence] = (), pool_indices: torch.Tensor | None = None
                 ) -> StepLogits:
        input_ids, positions, meta, logits_indices = model_inputs
        pooled = None
        if pooled_seqs:
            logits, pooled = self.model.forward_pooled(*model_inputs, pool_indices)
        elif self._replays(meta, logits_indices):
            self.graph_rows = None  # until the buffers hold this step's rows
            logits = self.graphs.run(input_ids, positions, meta)
            self.graph_rows = sampling_seqs
        else:
            logits = self.model(*model_inputs)
        sampled, prompt = logits[:num_sampled], logits[num_sampled:]
        return StepLogits(sampling_seqs, sampled, rows, [PromptLogits(seq, first, prompt[offset : offset + count])
                                                         for seq, first, offset, count in prompt_spans if count],
                          list(pooled_seqs), pooled)

    def _set_lora_rows(self, seqs: list[Sequence], num_rows: list[int]) -> None:
        """Tell the model's linears which of the step's rows (each sequence's, consecutive) run which adapter."""
        if self.lora_step is None:
            return
        rows_of: dict[int, list[int]] = {}
        adapter_of_row = array("q")  # 1 + the adapter's index; 0: the base model
        for seq, count in zip(seqs, num_rows):
            index = -1 if seq.lora_name is None else self.lora_step.index[seq.lora_name]
            if index >= 0:
                rows_of.setdefault(index, []).extend(range(len(adapter_of_row), len(adapter_of_row) + count))
            adapter_of_row.extend([index + 1] * count)
        everyone = len(rows_of) == 1 and len(next(iter(rows_of.values()))) == len(adapter_of_row)
        groups = [(index, None if everyone else self._tensor(rows)) for index, rows in rows_of.items()]
        row_adapters = None
        if rows_of and not everyone:
            one_hot = torch.nn.functional.one_hot(self._tensor(adapter_of_row), self.lora_step.slots + 1)
            row_adapters = one_hot[:, 1:].to(self.dtype)
        self.lora_step.set_rows(groups, row_adapters)

    def _replays(self, meta: AttentionMetadata, logits_indices: torch.Tensor) -> bool:
        """Whether a captured graph runs this step: decodes only, each sampling one row, within the graphs' batch, no
        LoRA adapter among them (the graphs hold the base model's linears only)."""
        graphs, decode = self.graphs, meta.decode
        if self.lora_step is not None and self.lora_step.active:
            return False
        return (graphs is not None and decode is not None and meta.prefill_batch is None and not meta.prefills
                and logits_indices.shape[0] == decode.size <= graphs.max_batch
                and decode.block_tables.shape[1] <= graphs.block_tables.shape[1])

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Every layer's K and V of each source block into its target block."""
        sources, targets = (self._tensor(list(ids)) for ids in zip(*copies))
        pool = raw(self.kv_cache)
        pool.index_copy_(3, targets, pool.index_select(3, sources))

    def _metadata(self, seqs: list[Sequence], num_new_tokens: list[int], start: int, slots: torch.Tensor,
                  decode: DecodeBatch | None, device: Iterator[torch.Tensor]) -> AttentionMetadata:
        """The step's attention metadata; `seqs` are its prefill chunks, which start at row `start`."""
        if self.triton:
            prefill = PrefillBatch(next(device), next(device), next(device).view(len(seqs), -1),
                                   max(num_new_tokens)) if seqs else None
            return AttentionMetadata(self.kv_layers, slots, decode, [], None, self.kv_cache, prefill, True)
        prefills = []
        for seq, num_new in zip(seqs, num_new_tokens):
            prefills.append(PrefillChunk(start, start + num_new, seq.num_computed_tokens + num_new, next(device)))
            start += num_new
        return AttentionMetadata(self.kv_layers, slots, decode, prefills, self.write_kv, self.kv_cache,
                                 prefill_kernel=self.prefill_kernel)

    def _prefill_lists(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[list[int]]:
        """The host side of the prefill chunks' metadata: for Triton, query starts, context lengths and the padded
        block tables of all of them; else each chunk's block table."""
        context_lens = [seq.num_computed_tokens + num_new for seq, num_new in zip(seqs, num_new_tokens)]
        if not self.triton:
            return [seq.block_table[: -(-n // self.block_size)] for seq, n in zip(seqs, context_lens)]
        if not seqs:
            return []
        starts = [0]
        for num_new in num_new_tokens:
            starts.append(starts[-1] + num_new)
        width = max(-(-n // self.block_size) for n in context_lens)
        return [starts, context_lens, _padded_flat([seq.block_table[:width] for seq in seqs], width)]

    @staticmethod
    def _decode_lists(seqs: list[Sequence], context_lens: list[int]) -> list[list[int]]:
        """The host side of a DecodeBatch: block tables padded to one width (flat), and context lengths."""
        width = max(len(seq.block_table) for seq in seqs)
        return [_padded_flat([seq.block_table for seq in seqs], width), context_lens]

    def _decode_batch(self, size: int, longest: int, device: Iterator[torch.Tensor]) -> DecodeBatch:
        """`size` sequences, the longest context `longest` tokens."""
        tables, lens = next(device).view(size, -1), next(device)
        splits = 1
        if self.num_splits_for is not None:
            splits = self.num_splits_for(size, self.kv_cache.shape[2], longest, self.num_sms)
        return DecodeBatch(tables, lens, self.block_size, self.decode_kernel, splits)

    def _upload(self, parts: list[list[int] | array]) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
        """Host int lists and int64 arrays to the device together: one pinned buffer and one copy, split into views
        there (the first H100 profile counted ~44 copies a step, each a pinned allocation and a cudaMemcpyAsync). A
        compiled decoder (CPU only) takes a tensor each: views of one buffer would make it guard on how its inputs
        alias, and compile again."""
        if getattr(self.model, "compiled", None) is not None:
            return [self._tensor(part) for part in parts]
        buffer = array("q")
        for part in parts:
            buffer.extend(part)  # an array by memcpy, a list id by id
        return self._tensor(buffer).split([len(part) for part in parts])

    def _tensor(self, values: list[int] | array) -> torch.Tensor:
        """Host ints to the device without waiting for it, by way of an array: at a batch of 256, torch.tensor of the
        step's list of ~8,500 ints took 480 us, the array 136."""
        if not values:
            return torch.empty(0, dtype=torch.long, device=self.device)
        # a copy (a memcpy from an array): the tensor shares its memory, and an array whose memory is shared cannot grow
        return to_device(torch.frombuffer(array("q", values), dtype=torch.long), self.device)


class _StepRows:
    """The host lists of one step's flat batch, built a sequence at a time: each new token's id, position and pool
    slot; which rows sample (the last real token and each draft of a sequence that is up to date) and which score
    the prompt (prompt logprobs)."""

    def __init__(self):
        self.input_ids, self.positions, self.slots, self.sample_indices = [], [], [], []
        self.sampling_seqs: list[Sequence] = []
        self.rows: list[int] = []  # per sampling sequence: its rows (1 + its drafts)
        self.prompt_indices: list[int] = []
        self.prompt_spans: list[tuple[Sequence, int, int, int]] = []  # (seq, first position, offset, count)
        self.pool_indices: list[int] = []  # the last prompt row of each embedding request whose prompt ends now
        self.pooled_seqs: list[Sequence] = []

    def add(self, seq: Sequence, num_new: int, drafts: list[int], block_size: int) -> None:
        start = seq.num_computed_tokens
        if num_new == 1 and start == len(seq) - 1 and seq.params.prompt_logprobs is None and seq.pooling is None:
            self._add_decode(seq, start, block_size)  # the common row, without the general case's ranges
            return
        end = start + num_new
        if seq.params.prompt_logprobs is not None:  # positions predicting a prompt token (not the first output)
            count = max(0, min(end, seq.num_prompt_tokens - 1) - start)
            self.prompt_spans.append((seq, start + 1, len(self.prompt_indices), count))
            self.prompt_indices.extend(range(len(self.input_ids), len(self.input_ids) + count))
        self.input_ids.extend(seq.token_ids[start : end - len(drafts)] + drafts)
        self.positions.extend(range(start, end))
        self.slots.extend(_slot(seq.block_table, p, block_size) for p in range(start, end))
        if end == len(seq) and seq.pooling is not None:
            self.pool_indices.append(len(self.input_ids) - 1)
            self.pooled_seqs.append(seq)
        elif end - len(drafts) == len(seq):
            self.sample_indices.extend(range(len(self.input_ids) - 1 - len(drafts), len(self.input_ids)))
            self.sampling_seqs.append(seq)
            self.rows.append(1 + len(drafts))

    def _add_decode(self, seq: Sequence, position: int, block_size: int) -> None:
        self.input_ids.append(seq.token_ids[position])
        self.positions.append(position)
        self.slots.append(_slot(seq.block_table, position, block_size))
        self.sample_indices.append(len(self.input_ids) - 1)
        self.sampling_seqs.append(seq)
        self.rows.append(1)


def _slot(block_table: array, position: int, block_size: int) -> int:
    """The pool slot of a sequence's token at `position`."""
    return block_table[position // block_size] * block_size + position % block_size


def _padded_flat(tables: list[array], width: int) -> array:
    """Block tables as rows of one width, padded with block 0 (the kernels read no further than each context), one
    after another: a memcpy a table."""
    flat = array("q", bytes(8 * width * len(tables)))
    for row, table in enumerate(tables):
        flat[row * width : row * width + len(table)] = table
    return flat
