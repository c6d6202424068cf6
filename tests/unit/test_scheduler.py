"""Scheduler invariants under random workloads, with a fake model that writes token ids into a fake KV pool."""
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import NO_HASH, BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


class FakeEngine:
    """Drives the scheduler like LLMEngine.step does; the 'KV' of a slot is the token id computed into it."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_tokens_per_step, prefix_caching=True, drafts=0,
                 wrong_draft_at=None, long_prefill=None, by_priority=False):
        self.drafts, self.wrong_draft_at = drafts, wrong_draft_at  # speculative drafts per step; where one goes wrong
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.bm, max_num_seqs, max_tokens_per_step, long_prefill, by_priority)
        self.pool = [None] * (num_blocks * block_size)
        self.finished: list[Sequence] = []

    def add(self, rid, prompt, max_tokens, leader=None, priority=0):
        s = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
        s.prompt_leader = leader  # a choice of the same n > 1 request, as RequestInbox sets it
        self.scheduler.add(s)
        return s

    def step(self):
        self.propose()
        batch = self.scheduler.schedule()
        self.check_invariants(batch)
        bs = self.bm.block_size
        for source, target in batch.block_copies:  # as ModelRunner does before the step
            self.pool[target * bs : (target + 1) * bs] = self.pool[source * bs : (source + 1) * bs]
        for s, n, drafts in zip(batch.seqs, batch.num_new_tokens, batch.draft_token_ids):
            inputs = s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n - len(drafts)] + drafts
            for pos, token in enumerate(inputs, start=s.num_computed_tokens):
                self.assert_context_intact(s, min(pos, len(s)))
                self.pool[self.slot(s, pos)] = token
        self.scheduler.mark_computed(batch)
        for s, drafts in zip(batch.seqs, batch.draft_token_ids):
            if s.num_computed_tokens == len(s):
                self.sample(s, drafts)
        self.finished += batch.out_of_memory
        return batch

    def sample(self, s, drafts):
        """Deterministic 'sampling' (so prefixes repeat), keeping the drafts that match it, as LLMEngine does."""
        for i in range(len(drafts) + 1):
            if i:
                self.scheduler.accept_draft(s)
            s.append_token(len(s) % 7)
            if s.num_output_tokens >= s.params.max_tokens:
                self.scheduler.finish(s, "length")
                self.finished.append(s)
                return
            if i == len(drafts) or drafts[i] != s.token_ids[-1]:
                break
        if drafts:
            self.scheduler.release_rejected(s)

    def propose(self):
        """Drafts for decoding sequences: the tokens sampling will give, with one wrong at `wrong_draft_at`."""
        for s in self.scheduler.running if self.drafts else ():
            if s.num_uncomputed_tokens == 1:
                s.draft_token_ids = [(len(s) + i) % 7 + (7 if i == self.wrong_draft_at else 0) for i in range(self.drafts)]

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
        assert all(n - len(d) <= sched.max_chunk for n, d in zip(batch.num_new_tokens, batch.draft_token_ids))
        assert len(sched.running) <= sched.max_num_seqs
        owners = Counter(b for s in sched.running for b in s.block_table)
        for s in sched.running:
            assert len(set(s.block_table)) == len(s.block_table), f"{s} owns a block twice"
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
        for s in sched.waiting:
            assert list(s.block_table) == [] and s.status is SequenceStatus.WAITING
        for block in bm.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), block
            assert (block.ref_count == 0) == (block.block_id in bm.free_blocks), block
        for h, copies in bm.hash_to_blocks.items():
            assert copies and all(bm.blocks[block_id].hash == h for block_id in copies)
        assert sum(map(len, bm.hash_to_blocks.values())) == sum(block.hash != NO_HASH for block in bm.blocks)
        for parent, tails in bm.tails.items():  # a findable tail is free and unpublished, indexed under its parent
            assert tails and all(bm.blocks[b].tail[0] == parent and bm.blocks[b].ref_count == 0
                                 and bm.blocks[b].hash == NO_HASH for b in tails)
        assert sum(map(len, bm.tails.values())) == sum(block.tail is not None for block in bm.blocks)

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
    choices=st.integers(1, 3),
    long_prefill=st.one_of(st.none(), st.integers(1, 24)),
    priorities=st.one_of(st.none(), st.lists(st.integers(-2, 2), min_size=12, max_size=12)),
)
def test_random_workloads_keep_every_invariant_and_finish(requests, num_blocks, block_size, max_num_seqs, budget, abort_at,
                                                          choices, long_prefill, priorities):
    """With `choices` > 1 every request also has siblings (n > 1), which copy their leader's partial prompt block:
    assert_context_intact reads the copy back. With `long_prefill`, no request computes more tokens in a step. With
    `priorities`, the priority policy orders both queues."""
    budget = max(budget, block_size)
    engine = FakeEngine(num_blocks, block_size, max_num_seqs, budget, long_prefill=long_prefill,
                        by_priority=priorities is not None)
    capacity = num_blocks * block_size
    seqs = []
    for i, (p, m) in enumerate(requests):
        if len(p) < capacity:
            rank = priorities[i] if priorities else 0
            leader = engine.add(str(i), p, m, priority=rank)
            seqs += [leader] + [engine.add(f"{i}.{c}", p, m, leader, rank) for c in range(1, choices)]
    aborts = dict(abort_at)
    for step in range(40):
        if step in aborts and aborts[step] < len(seqs) and not seqs[aborts[step]].is_finished:
            engine.scheduler.finish(seqs[aborts[step]], "abort")
        engine.step()
    engine.drain()
    assert all(s.is_finished for s in seqs)
    assert engine.bm.num_free_blocks == num_blocks, "every block returns to the pool"


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(st.tuples(prompts, st.integers(1, 20)), min_size=1, max_size=10),
    num_blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(8, 64),
    drafts=st.integers(1, 5),
    wrong_draft_at=st.one_of(st.none(), st.integers(0, 4)),
)
def test_speculative_drafts_keep_every_invariant_and_the_kv_of_rejected_drafts_never_counts(
        requests, num_blocks, block_size, budget, drafts, wrong_draft_at):
    """assert_context_intact reads every computed position back before each write: a rejected draft's slot counted
    as computed, or a published block holding one, would show there."""
    budget = max(budget, block_size)
    engine = FakeEngine(num_blocks, block_size, 4, budget, drafts=drafts, wrong_draft_at=wrong_draft_at)
    seqs = [engine.add(str(i), p, m) for i, (p, m) in enumerate(requests) if len(p) < num_blocks * block_size]
    engine.drain()
    assert all(s.is_finished for s in seqs)
    assert all(s.output_token_ids == [n % 7 for n in range(s.num_prompt_tokens, len(s))] for s in seqs
               if s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens)
    assert engine.bm.num_free_blocks == num_blocks, "every block returns to the pool"


def test_drafts_are_scheduled_after_the_last_token_within_the_budget_and_never_preempt():
    bm = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=20))
    scheduler.add(a)
    scheduler.mark_computed(scheduler.schedule())
    a.append_token(4)
    a.draft_token_ids = [5, 6, 7]
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [4] and batch.draft_token_ids == [[5, 6, 7]] and a.draft_token_ids == []
    assert len(a.block_table) == 2  # slots 0..6
    scheduler.mark_computed(batch)
    assert a.num_computed_tokens == 4, "a draft's slot counts only once it is confirmed"
    a.append_token(5)
    scheduler.accept_draft(a)
    a.append_token(9)  # the model chose 9 where the draft said 6
    scheduler.release_rejected(a)
    assert a.num_computed_tokens == 5 and len(a) == 6 and len(a.block_table) == 2
    a.draft_token_ids = [1, 2, 3, 4, 5, 6, 7]
    batch = scheduler.schedule()  # 7 drafts need a fourth block: halved until they fit the pool
    assert batch.num_new_tokens == [4] and batch.draft_token_ids == [[1, 2, 3]] and not batch.preempted
    scheduler.mark_computed(batch)
    a.append_token(7)  # all three drafts rejected
    scheduler.release_rejected(a)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 1, "the block that only held rejected drafts is back"


def test_waiting_requests_are_admitted_in_arrival_order():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=2, max_tokens_per_step=16)
    seqs = [engine.add(str(i), [i, i + 1, i + 2], 3) for i in range(6)]
    engine.drain()
    first_scheduled = [s.metrics.first_scheduled_time for s in seqs]
    assert first_scheduled == sorted(first_scheduled)


def test_the_priority_policy_admits_lower_values_first_then_by_arrival():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=1, max_tokens_per_step=16, by_priority=True)
    ranks = [3, 1, 2, 1, 0]
    seqs = [engine.add(str(i), [i, i + 1, i + 2], 3, priority=rank) for i, rank in enumerate(ranks)]
    engine.drain()
    order = sorted(seqs, key=lambda s: s.metrics.first_scheduled_time)
    assert [s.request_id for s in order] == ["4", "1", "3", "2", "0"]


def test_the_priority_policy_preempts_the_lowest_priority_however_old():
    engine = FakeEngine(num_blocks=6, block_size=2, max_num_seqs=4, max_tokens_per_step=64, prefix_caching=False,
                        by_priority=True)
    old = engine.add("old", [1, 2, 3], 6, priority=5)
    engine.step()
    new = engine.add("new", [4, 5, 6], 6, priority=0)
    preempted = []
    while engine.scheduler.num_unfinished:
        preempted += [s.request_id for s in engine.step().preempted]
    assert preempted and set(preempted) == {"old"}
    assert new.num_preemptions == 0 and old.is_finished


def test_decode_and_prefill_chunks_share_a_step():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=4, max_tokens_per_step=8)
    first = engine.add("a", [1, 2, 3], 10)
    engine.step()
    second = engine.add("b", list(range(20)), 2)
    batch = engine.step()
    assert dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens)) == {"a": 1, "b": 7}
    engine.drain()
    assert first.is_finished and second.is_finished


def test_a_prompt_being_scored_goes_in_small_chunks_beside_a_plain_one():
    engine = FakeEngine(num_blocks=512, block_size=16, max_num_seqs=4, max_tokens_per_step=2048)
    SCORED_CHUNK = engine.scheduler.max_scored_tokens
    assert SCORED_CHUNK == 2048 // 8
    scored = Sequence("scored", list(range(1000)), SamplingParams(max_tokens=1, prompt_logprobs=0))
    engine.scheduler.add(scored)
    plain = engine.add("plain", list(range(5000, 6000)), 1)
    batch = engine.step()
    assert dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens)) == {"scored": SCORED_CHUNK, "plain": 1000}
    chunks = [SCORED_CHUNK]
    while not scored.is_finished:  # it asked for one token: it ends with its prompt
        batch = engine.step()
        chunks.append(dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens))["scored"])
    assert chunks == [SCORED_CHUNK] * (1000 // SCORED_CHUNK) + [1000 % SCORED_CHUNK]
    engine.drain()
    assert scored.is_finished and plain.is_finished


def test_prompts_being_scored_share_one_chunk_a_step():
    engine = FakeEngine(num_blocks=512, block_size=16, max_num_seqs=4, max_tokens_per_step=2048)
    SCORED_CHUNK = engine.scheduler.max_scored_tokens
    assert SCORED_CHUNK == 2048 // 8
    length = 2 * SCORED_CHUNK + SCORED_CHUNK // 3
    two = [Sequence(f"scored-{i}", list(range(1000 * i, 1000 * i + length)), SamplingParams(max_tokens=2, prompt_logprobs=0))
           for i in (1, 2)]
    for seq in two:
        engine.scheduler.add(seq)
    steps = [engine.step().num_new_tokens for _ in range(4)]
    third = SCORED_CHUNK // 3
    # the second starts in the first's last prompt step, and takes a whole share once the first decodes
    assert steps == [[SCORED_CHUNK], [SCORED_CHUNK], [third, SCORED_CHUNK - third], [1, SCORED_CHUNK]]
    engine.drain()
    assert all(seq.is_finished for seq in two)


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
    # four shared blocks and three slots of the leader's fifth, copied: the sibling computes its prompt's last token
    assert sibling.num_cached_tokens == 19 and sibling.block_table[:4] == leader.block_table[:4]
    while engine.scheduler.num_unfinished:
        engine.step()
    assert engine.bm.num_free_blocks == 64


def test_a_sibling_copies_its_leaders_partial_prompt_block_and_computes_only_the_last_token():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=64)
    prompt = list(range(19))  # 4 full blocks, then 3 tokens in a fifth
    leader = engine.add("a", prompt, max_tokens=3)
    sibling = engine.add("b", prompt, max_tokens=3, leader=leader)
    engine.step()
    batch = engine.step()
    assert batch.seqs == [leader, sibling] and batch.num_new_tokens == [1, 1]
    assert batch.block_copies == [(leader.block_table[4], sibling.block_table[4])]
    assert sibling.block_table[:4] == leader.block_table[:4] and sibling.block_table[4] != leader.block_table[4]
    assert engine.pool[sibling.block_table[4] * 4 : sibling.block_table[4] * 4 + 3] == [16, 17, 18]
    engine.drain()
    assert sibling.output_token_ids == leader.output_token_ids and engine.bm.num_free_blocks == 64


def test_a_sibling_copies_the_partial_block_its_finished_leader_freed():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=1, max_tokens_per_step=64)
    prompt = list(range(19))
    leader = engine.add("a", prompt, max_tokens=1)
    sibling = engine.add("b", prompt, max_tokens=1, leader=leader)
    engine.step()  # the leader computes the prompt and finishes, freeing its partial block
    freed_tail = next(b.block_id for b in engine.bm.blocks if b.tail is not None)
    batch = engine.step()
    assert leader.is_finished and batch.seqs == [sibling]
    assert batch.num_new_tokens == [1] and [source for source, _ in batch.block_copies] == [freed_tail]
    engine.drain()


def test_a_prompt_continuing_a_finished_sequence_copies_only_the_slots_it_shares():
    engine = FakeEngine(num_blocks=64, block_size=8, max_num_seqs=4, max_tokens_per_step=64)
    first = engine.add("a", list(range(12)), max_tokens=2)  # one full block, then 4 prompt tokens and 1 output computed
    engine.drain()
    assert first.is_finished
    same_start = engine.add("b", list(range(10)) + [99, 98, 97], max_tokens=1)  # shares 2 of the tail's 5 slots
    batch = engine.step()
    assert batch.seqs == [same_start] and batch.num_new_tokens == [3] and len(batch.block_copies) == 1
    other = engine.add("c", [50] * 8 + list(range(8, 12)), max_tokens=1)  # another first block: another chain
    batch = engine.step()
    assert batch.seqs == [other] and batch.block_copies == [] and batch.num_new_tokens == [12]
    engine.drain()
    assert engine.bm.num_free_blocks == 64


def test_a_freed_tail_taken_for_other_tokens_is_found_no_more():
    engine = FakeEngine(num_blocks=2, block_size=4, max_num_seqs=1, max_tokens_per_step=64)
    engine.add("a", [1, 2, 3, 4, 5, 6], max_tokens=1)
    engine.drain()
    assert sum(b.tail is not None for b in engine.bm.blocks) == 1
    engine.add("b", [7, 7, 7, 7, 7, 7, 7], max_tokens=1)  # needs both blocks: the tail's too
    engine.drain()
    again = engine.add("c", [1, 2, 3, 4, 5, 6, 8], max_tokens=1)
    batch = engine.step()
    assert batch.block_copies == [] and batch.num_new_tokens == [7] and again.num_cached_tokens == 0
    engine.drain()


@settings(max_examples=120, deadline=None)
@given(
    rounds=st.lists(st.lists(st.tuples(st.integers(0, 99), st.integers(0, 60), prompts, st.integers(1, 6)),
                             min_size=1, max_size=4), min_size=1, max_size=5),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 4),
)
def test_prompts_that_continue_finished_sequences_read_back_their_own_context(rounds, num_blocks, block_size,
                                                                             max_num_seqs):
    """Each round's prompts continue a cut of an earlier sequence (a beam search's next step, a chat's next turn):
    whatever comes from a freed tail, assert_context_intact reads every earlier slot back as its own token."""
    engine = FakeEngine(num_blocks, block_size, max_num_seqs, 64)
    history, capacity = [[0, 1, 2, 3, 0, 1, 2]], num_blocks * block_size
    for i, requests in enumerate(rounds):
        added = []
        for j, (pick, cut, extra, max_tokens) in enumerate(requests):
            base = history[pick % len(history)]
            prompt = (base[: cut % (len(base) + 1)] + extra)[: capacity - max_tokens - 1]
            if prompt:
                added.append(engine.add(f"{i}.{j}", prompt, max_tokens))
        engine.drain()
        history += [s.token_ids for s in added if s.finish_reason == "length" and len(s.token_ids) < capacity]
    assert engine.bm.num_free_blocks == num_blocks


def test_a_sibling_does_not_wait_for_a_preempted_leader():
    engine = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=8)
    leader = engine.add("a", list(range(20)), max_tokens=3)
    sibling = engine.add("b", list(range(20)), max_tokens=3)
    sibling.prompt_leader = leader
    engine.step()
    engine.scheduler.preempt(leader)  # back at the head of the queue, so it runs first anyway
    engine.step()
    assert leader.status is SequenceStatus.RUNNING


def test_a_long_prompt_is_spread_over_steps_of_the_threshold_while_decodes_keep_their_token_a_step():
    """long_prefill_token_threshold, as vLLM's: one request's tokens in a step are capped, so a 4k-token prompt is not
    one 1,024-token step after another for the streams decoding beside it."""
    engine = FakeEngine(num_blocks=256, block_size=16, max_num_seqs=8, max_tokens_per_step=1024, long_prefill=128)
    decoding = engine.add("decoding", list(range(40)), max_tokens=50)
    assert engine.step().num_new_tokens == [40]  # a short prompt is one chunk
    long_prompt = engine.add("long", list(range(100, 600)), max_tokens=2)
    steps = [dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens))
             for batch in (engine.step() for _ in range(4))]
    assert steps == [{"decoding": 1, "long": 128}] * 3 + [{"decoding": 1, "long": 500 - 3 * 128}]
    engine.drain()
    assert decoding.is_finished and long_prompt.is_finished
