"""Scheduler invariants under random workloads, with a fake model that writes token ids into a fake KV pool."""
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


class FakeEngine:
    """Drives the scheduler like LLMEngine.step does; the 'KV' of a slot is the token id computed into it."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_tokens_per_step, prefix_caching=True):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.bm, max_num_seqs, max_tokens_per_step)
        self.pool = [None] * (num_blocks * block_size)
        self.finished: list[Sequence] = []

    def add(self, rid, prompt, max_tokens):
        s = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens))
        self.scheduler.add(s)
        return s

    def step(self):
        batch = self.scheduler.schedule()
        self.check_invariants(batch)
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + n):
                self.assert_context_intact(s, pos)
                self.pool[self.slot(s, pos)] = s.token_ids[pos]
        self.scheduler.mark_computed(batch)
        for s in batch.seqs:
            if s.num_computed_tokens == len(s):
                s.append_token(len(s) % 7)  # deterministic 'sampling', so prefixes repeat
                if s.num_output_tokens >= s.params.max_tokens:
                    self.scheduler.finish(s, "length")
                    self.finished.append(s)
        self.finished += batch.out_of_memory
        return batch

    def slot(self, s, pos):
        bs = self.bm.block_size
        return s.block_table[pos // bs] * bs + pos % bs

    def assert_context_intact(self, s, pos):
        """Every earlier position of the sequence reads back its own token: cache hits and shared blocks are right."""
        for earlier in range(pos):
            assert self.pool[self.slot(s, earlier)] == s.token_ids[earlier], (s, earlier)

    def check_invariants(self, batch):
        sched, bm = self.scheduler, self.bm
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        owners = Counter(b for s in sched.running for b in s.block_table)
        for s in sched.running:
            assert len(set(s.block_table)) == len(s.block_table), f"{s} owns a block twice"
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
        for s in sched.waiting:
            assert s.block_table == [] and s.status is SequenceStatus.WAITING
        for block in bm.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), block
            assert (block.ref_count == 0) == (block.block_id in bm.free_blocks), block
        for h, block_id in bm.hash_to_block.items():
            assert bm.blocks[block_id].hash == h

    def drain(self, max_steps=5000):
        for _ in range(max_steps):
            if not self.scheduler.num_unfinished:
                return
            self.step()
        raise AssertionError("no forward progress")


prompts = st.lists(st.integers(0, 3), min_size=1, max_size=40)  # a tiny vocabulary: many shared prefixes


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(st.tuples(prompts, st.integers(1, 20)), min_size=1, max_size=12),
    num_blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(8, 64),
    abort_at=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 11)), max_size=4),
)
def test_random_workloads_keep_every_invariant_and_finish(requests, num_blocks, block_size, max_num_seqs, budget, abort_at):
    budget = max(budget, block_size)
    engine = FakeEngine(num_blocks, block_size, max_num_seqs, budget)
    capacity = num_blocks * block_size
    seqs = [engine.add(str(i), p, m) for i, (p, m) in enumerate(requests) if len(p) < capacity]
    aborts = dict(abort_at)
    for step in range(40):
        if step in aborts and aborts[step] < len(seqs) and not seqs[aborts[step]].is_finished:
            engine.scheduler.finish(seqs[aborts[step]], "abort")
        engine.step()
    engine.drain()
    assert all(s.is_finished for s in seqs)
    assert engine.bm.num_free_blocks == num_blocks, "every block returns to the pool"


def test_waiting_requests_are_admitted_in_arrival_order():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=2, max_tokens_per_step=16)
    seqs = [engine.add(str(i), [i, i + 1, i + 2], 3) for i in range(6)]
    engine.drain()
    first_scheduled = [s.metrics.first_scheduled_time for s in seqs]
    assert first_scheduled == sorted(first_scheduled)


def test_decode_and_prefill_chunks_share_a_step():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=4, max_tokens_per_step=8)
    first = engine.add("a", [1, 2, 3], 10)
    engine.step()
    second = engine.add("b", list(range(20)), 2)
    batch = engine.step()
    assert dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens)) == {"a": 1, "b": 7}
    engine.drain()
    assert first.is_finished and second.is_finished


def test_preemption_takes_the_newest_and_the_oldest_keeps_running():
    engine = FakeEngine(num_blocks=6, block_size=2, max_num_seqs=4, max_tokens_per_step=64, prefix_caching=False)
    old = engine.add("old", [1, 2, 3], 6)
    new = engine.add("new", [4, 5, 6], 6)
    preempted = []
    while engine.scheduler.num_unfinished:
        preempted += [s.request_id for s in engine.step().preempted]
    assert preempted and set(preempted) == {"new"}
    assert old.num_preemptions == 0 and new.is_finished


def test_a_sequence_too_big_for_the_whole_pool_finishes_with_length():
    engine = FakeEngine(num_blocks=2, block_size=2, max_num_seqs=1, max_tokens_per_step=8)
    s = engine.add("big", [1, 2, 3], 100)
    engine.drain()
    # 4 slots hold 4 tokens of KV; the token sampled from the last of them is output without needing a slot
    assert s.finish_reason == "length" and len(s) == 5 and engine.bm.num_free_blocks == 2


def test_abort_frees_blocks_at_once():
    engine = FakeEngine(num_blocks=16, block_size=2, max_num_seqs=4, max_tokens_per_step=64)
    s = engine.add("a", list(range(9)), 50)
    engine.step()
    assert engine.bm.num_free_blocks < 16
    engine.scheduler.finish(s, "abort")
    assert engine.bm.num_free_blocks == 16 and s.finish_reason == "abort"


def test_a_sibling_waits_for_its_leaders_prompt_then_shares_its_blocks():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=8)
    prompt = list(range(20))
    leader = engine.add("a", prompt, max_tokens=3)
    sibling = engine.add("b", prompt, max_tokens=3)
    sibling.prompt_leader = leader
    engine.step()  # the leader's first chunk of 8: the sibling must not compute the same tokens beside it
    assert sibling.status is SequenceStatus.WAITING and leader.num_computed_tokens == 8
    while leader.num_computed_tokens < leader.num_prompt_tokens:
        engine.step()
        assert sibling.status is SequenceStatus.WAITING or leader.num_computed_tokens >= leader.num_prompt_tokens
    engine.step()
    assert sibling.status is SequenceStatus.RUNNING
    assert sibling.num_cached_tokens == 16 and sibling.block_table[:4] == leader.block_table[:4]
    while engine.scheduler.num_unfinished:
        engine.step()
    assert engine.bm.num_free_blocks == 64


def test_a_sibling_does_not_wait_for_a_preempted_leader():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=8)
    leader = engine.add("a", list(range(20)), max_tokens=3)
    sibling = engine.add("b", list(range(20)), max_tokens=3)
    sibling.prompt_leader = leader
    engine.step()
    engine.scheduler.preempt(leader)  # back at the head of the queue, so it runs first anyway
    engine.step()
    assert leader.status is SequenceStatus.RUNNING
