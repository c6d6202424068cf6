"""Iteration-level scheduler: FCFS or by priority, chunked prefill mixed with decode, preemption by recompute.
Torch-free."""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus

# Requests that asked for prompt logprobs share this fraction of a step's token budget. Each scored row also takes
# the LM head and a log-softmax over the vocabulary, and a whole budget of them is the costliest step there is: with
# the CPU config's 1,024 a step of 128 scored tokens over a 4k-token context takes 0.3-0.45 s on 2 cores in fp32, so
# another client's stream keeps a token a second under an echo attack; the GPU config's 4,096 scores 512 a step.
SCORED_SHARE = 8


def _serving_key(seq: Sequence) -> tuple[int, float]:
    return seq.priority, seq.metrics.arrival_time


def _scoring_prompt(seq: Sequence) -> bool:
    return seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # speculative drafts included
    draft_token_ids: list[list[int]] = field(default_factory=list)  # per sequence, fed after its last real token
    preempted: list[Sequence] = field(default_factory=list)
    out_of_memory: list[Sequence] = field(default_factory=list)  # finished: the pool cannot hold them at all
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, target) KV blocks, before the step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new_tokens: int, drafts: list[int] | None = None) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.draft_token_ids.append(drafts or [])

    @classmethod
    def one_token_each(cls, seqs: list[Sequence]) -> "ScheduledBatch":
        """A decode step of `seqs`, without drafts."""
        return cls(seqs=list(seqs), num_new_tokens=[1] * len(seqs), draft_token_ids=[[] for _ in seqs])

    def subset(self, indices: list[int]) -> "ScheduledBatch":
        part = ScheduledBatch(block_copies=self.block_copies)  # copying again is harmless
        for i in indices:
            part.add(self.seqs[i], self.num_new_tokens[i], self.draft_token_ids[i])
        return part


class Scheduler:
    """Both queues are kept in serving order: arrival (FCFS), or (priority, arrival) with `by_priority`, as vLLM's
    priority policy orders them (a lower value first). A step serves the running queue from its front and preempts
    from its back, so the last served is the first preempted, under either order."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int | None = None, by_priority: bool = False):
        self.block_manager = block_manager
        self.by_priority = by_priority
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_chunk = long_prefill_token_threshold or max_num_batched_tokens  # one request's tokens in a step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in serving order; preemption takes from the end
        self.num_preemptions = 0
        self.max_scored_tokens = max(1, max_num_batched_tokens // SCORED_SHARE)
        self._scored_left = self.max_scored_tokens  # of this step's prompt tokens for requests that score their prompt

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq)

    def _enqueue(self, queue: deque[Sequence] | list[Sequence], seq: Sequence) -> None:
        """At the back, or after every sequence served before it (equal keys keep their arrival order)."""
        if self.by_priority:
            queue.insert(bisect.bisect_right(queue, _serving_key(seq), key=_serving_key), seq)
        else:
            queue.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._scored_left = self.max_scored_tokens
        budget = self._schedule_running(batch)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        return batch

    def _schedule_running(self, batch: ScheduledBatch) -> int:
        budget = self.max_num_batched_tokens
        index = 0
        block_size = self.block_manager.block_size
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if (len(seq.token_ids) - seq.num_computed_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
                    and not seq.draft_token_ids and len(seq.block_table) * block_size >= len(seq.token_ids)):
                batch.add(seq, 1)  # a decode within its blocks, the common row: nothing to allocate, no budget rule
                budget -= 1
                index += 1
                continue
            num_new = min(seq.num_uncomputed_tokens, self._chunk_budget(seq, budget))
            if num_new == 0:  # a prompt being scored, past this step's share: the next step
                index += 1
                continue
            if not self._make_room(seq, seq.num_computed_tokens + num_new, batch):
                break
            drafts = self._drafts_that_fit(seq, num_new, budget)
            self.block_manager.grow(seq, seq.num_computed_tokens + num_new + len(drafts))
            batch.add(seq, num_new + len(drafts), drafts)
            self._took(seq, num_new)
            budget -= num_new + len(drafts)
            index += 1
        return budget

    def _chunk_budget(self, seq: Sequence, budget: int) -> int:
        """A request computes at most `max_chunk` tokens a step (long_prefill_token_threshold), and prompts being
        scored (prompt logprobs) share `max_scored_tokens` a step (SCORED_SHARE says why)."""
        budget = min(budget, self.max_chunk)
        return min(budget, self._scored_left) if _scoring_prompt(seq) else budget

    def _took(self, seq: Sequence, num_new: int) -> None:
        if _scoring_prompt(seq):
            self._scored_left -= num_new

    def _drafts_that_fit(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """A decoding sequence's proposed drafts, as many as the token budget and the free blocks hold: a draft never
        preempts anyone."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        if seq.num_uncomputed_tokens != 1:
            return []
        drafts = drafts[: budget - num_new]
        while drafts and not self.block_manager.can_grow(seq, seq.num_computed_tokens + num_new + len(drafts)):
            drafts = drafts[: len(drafts) // 2]
        return drafts

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest running sequences until `seq` fits; False if `seq` itself had to go."""
        while not self.block_manager.can_grow(seq, num_tokens):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self.finish(seq, "length")  # alone and still too big: the pool is its whole context
                batch.out_of_memory.append(seq)
                return False
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._leader_still_computing_prompt(seq):
                return
            # prompt logprobs need the logits of every prompt position: nothing may come from the cache
            matched = [] if seq.params.prompt_logprobs is not None else self.block_manager.match_prefix(
                seq.token_ids, seq.cache_salt, seq.lora_key)
            num_cached = len(matched) * self.block_manager.block_size
            tail = self._leaders_tail_block(seq, len(matched))
            if tail is not None:
                num_cached = len(seq) - 1
            elif seq.params.prompt_logprobs is None and (found := self.block_manager.match_tail(
                    seq.token_ids, matched, seq.cache_salt, seq.lora_key)) is not None:
                tail, shared = found  # a freed sequence's partly computed block that this prompt continues
                num_cached += shared
            copied = num_cached - len(matched) * self.block_manager.block_size
            num_new = min(len(seq) - num_cached, self._chunk_budget(seq, budget))
            if num_new <= 0:
                return
            if not self.block_manager.can_allocate(matched, num_cached + num_new):
                if self.running:
                    return
                num_new = self._largest_chunk_that_fits(matched, num_cached)
                if num_new <= 0:
                    return
            self.waiting.popleft()
            self.block_manager.allocate(seq, matched, num_cached + num_new, copied)
            if tail is not None:
                batch.block_copies.append((tail, seq.block_table[len(matched)]))
            seq.status = SequenceStatus.RUNNING
            self._enqueue(self.running, seq)
            batch.add(seq, num_new)
            self._took(seq, num_new)
            budget -= num_new

    def _leader_still_computing_prompt(self, seq: Sequence) -> bool:
        """A sibling of an n > 1 request waits while its leader computes their common prompt, then finds those blocks
        in the prefix cache instead of computing them again. FCFS holds: the leader was admitted before it."""
        leader = self._running_leader(seq)
        return leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens

    def _running_leader(self, seq: Sequence) -> Sequence | None:
        """The sibling's leader while its blocks may be shared: running, with the prefix cache on."""
        leader = seq.prompt_leader
        if leader is None or not self.block_manager.enable_prefix_caching or leader.status is not SequenceStatus.RUNNING:
            return None
        return leader

    def _leaders_tail_block(self, seq: Sequence, num_matched: int) -> int | None:
        """The leader's block holding the prompt's last, partial block, where a new sibling may copy it instead of
        computing it again: it then computes only the prompt's last token, for its logits, as a decode would. On a CPU
        each of the n - 1 siblings computing up to 15 tokens attended over the whole context made the step where
        they joined the longest of an echo attack (0.7 s against 0.47 s, 4,090-token prompts, fp32)."""
        leader, prompt_len = self._running_leader(seq), len(seq)
        tail_index, tail_tokens = divmod(prompt_len - 1, self.block_manager.block_size)
        if (leader is None or seq.params.prompt_logprobs is not None or prompt_len != seq.num_prompt_tokens
                or num_matched != tail_index or tail_tokens == 0):
            return None
        leader_holds_it = leader.num_computed_tokens >= prompt_len - 1 and len(leader.block_table) > tail_index
        if not leader_holds_it or leader.token_ids[:prompt_len] != seq.token_ids:
            return None
        return leader.block_table[tail_index]

    def _largest_chunk_that_fits(self, matched: list[int], num_cached: int) -> int:
        bm = self.block_manager
        reused_free = sum(1 for b in matched if bm.blocks[b].ref_count == 0)
        return (bm.num_free_blocks - reused_free + len(matched)) * bm.block_size - num_cached

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self._enqueue(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)  # it arrived before anything still waiting

    def mark_computed(self, batch: ScheduledBatch) -> None:
        """Advance past the real tokens of the step; a draft's position counts once it is confirmed (accept_draft)."""
        for seq, num_new, drafts in zip(batch.seqs, batch.num_new_tokens, batch.draft_token_ids):
            if not seq.is_finished:
                self.block_manager.mark_computed(seq, seq.num_computed_tokens + num_new - len(drafts))

    def accept_draft(self, seq: Sequence) -> None:
        """The next draft fed in this step was the token the model chose: its KV slot holds the right entry."""
        self.block_manager.mark_computed(seq, seq.num_computed_tokens + 1)

    def release_rejected(self, seq: Sequence) -> None:
        """Give back the blocks that only held rejected drafts."""
        if not seq.is_finished:
            self.block_manager.trim(seq, len(seq))

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finish_time = time.monotonic()
