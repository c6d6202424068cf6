"""BlockManager: ownership, ref counts, prefix-cache hits and lazy eviction. Torch-free."""
import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8))


def admit(bm, s):
    matched = bm.match_prefix(s.token_ids)
    assert bm.can_allocate(matched, len(s))
    bm.allocate(s, matched, len(s))
    bm.mark_computed(s, len(s))
    return matched


def test_allocation_covers_the_tokens_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    s = seq(range(10))
    admit(bm, s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 8 and list(s.block_table) == []


def test_shared_prefix_is_reused_and_ref_counted():
    bm = BlockManager(8, BS)
    a, b = seq(range(10), "a"), seq(list(range(8)) + [99, 98], "b")
    admit(bm, a)
    matched = admit(bm, b)
    assert matched == list(a.block_table[:2])
    assert b.num_computed_tokens == 10 and bm.prefix_cache_hits == 8
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(8, BS)
    a = seq(range(8), "a")
    admit(bm, a)
    assert len(bm.match_prefix(list(range(8)))) == 1  # the second block would cover the final prompt token


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    a = seq(range(9), "a")
    admit(bm, a)
    bm.free(a)
    assert len(bm.match_prefix(list(range(9)))) == 2
    hog = seq(range(100, 116), "hog")  # needs every block: evicts the cached ones
    admit(bm, hog)
    bm.free(hog)
    assert bm.match_prefix(list(range(9))) == []


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, BS)
    a = seq(range(5), "a")  # one full (cached) block and one partial
    admit(bm, a)
    bm.free(a)
    b = seq(range(200, 203), "b")
    admit(bm, b)
    assert len(bm.match_prefix(list(range(5)))) == 1  # b took a free uncached block, not a's cached one
    bm.free(b)


def test_a_block_computed_twice_stays_findable_when_one_copy_is_evicted():
    """A prompt scored for its logprobs skips the cache, so it computes blocks that are cached already. When the old
    copies were later reused, the prefix used to vanish although the scorer still held the same blocks: its n - 1
    siblings then recomputed 300 tokens each, and another client's stream waited 2.7 s."""
    bm = BlockManager(8, BS)
    old = seq(range(9), "old")
    admit(bm, old)
    old_copies = old.block_table[:2]  # its full blocks, the cached ones
    bm.free(old)
    scorer = seq(range(9), "scorer")
    bm.allocate(scorer, [], len(scorer))  # no prefix match, as the scheduler does for prompt logprobs
    bm.mark_computed(scorer, len(scorer))
    hog = seq(range(100, 120), "hog")  # the 5 free blocks, the old copies among them
    admit(bm, hog)
    assert set(old_copies) <= set(hog.block_table)
    assert bm.match_prefix(list(range(9))) == list(scorer.block_table[:2])
    for s in (scorer, hog):
        bm.free(s)
    assert bm.num_free_blocks == 8


def test_a_hash_collision_is_verified_not_trusted(monkeypatch):
    import engine.block_manager as module

    monkeypatch.setattr(module, "hash_block", lambda tokens, parent: 7)  # every block hashes alike
    bm = BlockManager(8, BS)
    admit(bm, seq(range(5), "a"))
    assert bm.match_prefix([9, 9, 9, 9, 9]) == []


def test_grow_refuses_beyond_the_pool():
    bm = BlockManager(2, BS)
    s = seq(range(4))
    admit(bm, s)
    assert bm.can_grow(s, 8) and not bm.can_grow(s, 9)
    with pytest.raises(RuntimeError):
        bm.grow(s, 9)
    bm.free(s)


def test_block_hashes_are_digests_chained_from_the_salt():
    from engine.block_manager import NO_HASH, hash_block, root_hash

    first = hash_block((1, 2, 3, 4), NO_HASH)
    assert isinstance(first, bytes) and len(first) == 16 and first == hash_block((1, 2, 3, 4), NO_HASH)
    assert hash_block((1, 2, 3, 5), NO_HASH) != first and hash_block((1, 2, 3, 4), first) != first
    assert root_hash(None) == NO_HASH and root_hash("a") != root_hash("b") and root_hash("a") == root_hash("a")
    # the salt is not a token block: no token ids can reproduce a salted root
    assert root_hash("a") != hash_block((), NO_HASH)


def test_a_cache_salt_keeps_tenants_apart_and_the_same_salt_shares():
    bm = BlockManager(16, BS)
    tokens = list(range(9))
    a = Sequence("a", tokens, SamplingParams(max_tokens=8), cache_salt="tenant-a")
    admit(bm, a)
    assert bm.match_prefix(tokens) == []  # unsalted callers cannot hit (or time) a salted prompt
    assert bm.match_prefix(tokens, "tenant-b") == []
    assert len(bm.match_prefix(tokens, "tenant-a")) == 2
    plain = seq(tokens, "plain")
    admit(bm, plain)
    assert len(bm.match_prefix(tokens)) == 2 and bm.match_prefix(tokens, "tenant-b") == []
