"""Paged KV bookkeeping with automatic prefix caching. Torch-free: block ids index the model runner's pool.

A full block's identity is its tokens plus its parent's hash. Freed blocks keep their contents and stay
findable until the allocator reuses them (lazy eviction); blocks nobody can hit are reused first. A freed
sequence's last, partly computed block stays findable too (a tail): a prompt that continues it copies its computed
slots instead of computing them again, as each step of a beam search continues the step before.

Hashes are BLAKE2b digests, not Python's hash(): crafted collisions could otherwise map one tenant's prompt onto
another's blocks (CVE-2025-25183 in vLLM). A chain starts from the request's cache_salt, so tenants that use
different salts never share a block and cannot time each other's prompts (CVE-2025-46570).
"""
from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict

from engine.sequence import Sequence

NO_HASH = b""
DIGEST_BYTES = 16


def hash_block(token_ids: tuple[int, ...], parent_hash: bytes) -> bytes:
    digest = hashlib.blake2b(parent_hash, digest_size=DIGEST_BYTES)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def root_hash(cache_salt: str | None, lora_key: str | None = None) -> bytes:
    """The parent of a sequence's first block: empty for the base model without a salt, else a digest no token block
    can produce. A LoRA adapter computes other K and V from the same tokens, so its chains start apart too."""
    if lora_key is not None:
        key = json.dumps([cache_salt, lora_key]).encode("utf-8")
        return hashlib.blake2b(key, digest_size=DIGEST_BYTES, person=b"lora_root").digest()
    if cache_salt is None:
        return NO_HASH
    return hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=DIGEST_BYTES, person=b"cache_salt").digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "key", "tail")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.key: tuple[bytes, tuple[int, ...]] | None = None  # (parent_hash, token_ids), verified on every hit
        self.tail: tuple[bytes, tuple[int, ...]] | None = None  # a freed tail's (parent_hash, computed token_ids)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.hash != NO_HASH})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # reuse from the front
        # every block holding a hash: a prompt scored for its logprobs skips the cache and computes blocks that are
        # already cached, and one copy's eviction must not hide the other (vLLM's BlockPool keeps them all too)
        self.hash_to_blocks: dict[bytes, dict[int, None]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_evictions = 0  # cached blocks reused for other content
        self.tails: dict[bytes, dict[int, None]] = {}  # parent hash -> freed tail blocks that continue it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], cache_salt: str | None = None, lora_key: str | None = None) -> list[int]:
        """Block ids holding the longest cached run of full blocks; the last token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        parent = root_hash(cache_salt, lora_key)
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            key = (parent, tuple(token_ids[start : start + self.block_size]))
            block_id = next(iter(self.hash_to_blocks.get(hash_block(key[1], parent), ())), None)
            if block_id is None or self.blocks[block_id].key != key:
                break
            matched.append(block_id)
            parent = self.blocks[block_id].hash
        return matched

    def match_tail(self, token_ids: list[int], matched: list[int], cache_salt: str | None = None,
                   lora_key: str | None = None) -> tuple[int, int] | None:
        """A freed tail continuing the `matched` full blocks, as (block id, how many of its computed slots this
        prompt shares), the most shared; the prompt's last token is always left to compute."""
        start = len(matched) * self.block_size
        wanted = token_ids[start : start + min(self.block_size - 1, len(token_ids) - 1 - start)]
        if not self.enable_prefix_caching or not wanted:
            return None
        parent = self.blocks[matched[-1]].hash if matched else root_hash(cache_salt, lora_key)
        best = None
        for block_id in self.tails.get(parent, ()):
            shared = _common_prefix(self.blocks[block_id].tail[1], wanted)
            if shared and (best is None or shared > best[1]):
                best = (block_id, shared)
        return best

    def can_allocate(self, matched: list[int], num_tokens: int) -> bool:
        """Whether a waiting sequence can hold `num_tokens` slots, reusing the `matched` prefix blocks."""
        reused_free = sum(1 for b in matched if self.blocks[b].ref_count == 0)
        fresh = max(0, self.blocks_needed(num_tokens) - len(matched))
        return fresh + reused_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, matched: list[int], num_tokens: int, copied: int = 0) -> None:
        """Give a waiting sequence the `matched` prefix blocks and fresh ones up to `num_tokens` slots; `copied`
        slots of the first fresh block come from a tail block the step copies, found as the prefix cache's are."""
        assert not seq.block_table, f"{seq} already holds blocks"
        assert copied < self.block_size, f"{copied} copied slots fill a block"
        for block_id in matched:
            self._take(block_id, keep_cached=True)
        seq.block_table = array("q", matched)
        seq.num_computed_tokens = len(matched) * self.block_size + copied
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_prompt_tokens
            self.prefix_cache_hits += min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.grow(seq, num_tokens)

    # -- growth and release ----------------------------------------------------------------------

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table cover `num_tokens` slots."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"grow({seq}, {num_tokens}) needs {missing} blocks, {self.num_free_blocks} free")
        for _ in range(missing):
            seq.block_table.append(self._take(next(iter(self.free_blocks))))

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Advance the computed count and publish every block that just became full."""
        first_new_full = seq.num_computed_tokens // self.block_size
        seq.num_computed_tokens = num_computed_tokens
        if not self.enable_prefix_caching:
            return
        for index in range(first_new_full, num_computed_tokens // self.block_size):
            self._publish(seq, index)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` slots (written, never computed: rejected speculative drafts)."""
        assert num_tokens >= seq.num_computed_tokens, f"trim({seq}, {num_tokens}) would drop computed tokens"
        while len(seq.block_table) > self.blocks_needed(num_tokens):
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self._keep_tail(seq)
        # Tail blocks first, so the shared head of a prefix outlives it in the free list.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = array("q")
        seq.num_computed_tokens = 0

    # -- internals -----------------------------------------------------------------------------

    def _keep_tail(self, seq: Sequence) -> None:
        """Make the sequence's partly computed last block findable once freed, where it alone holds it and the
        blocks before it are published (the chain its tokens continue)."""
        index, computed = divmod(seq.num_computed_tokens, self.block_size)
        if not self.enable_prefix_caching or computed == 0 or index >= len(seq.block_table):
            return
        block = self.blocks[seq.block_table[index]]
        parent = self.blocks[seq.block_table[index - 1]].hash if index else root_hash(seq.cache_salt, seq.lora_key)
        if block.ref_count != 1 or block.hash != NO_HASH or (index and parent == NO_HASH):
            return
        self._drop_tail(block)
        start = index * self.block_size
        block.tail = (parent, tuple(seq.token_ids[start : start + computed]))
        self.tails.setdefault(parent, {})[block.block_id] = None

    def _drop_tail(self, block: Block) -> None:
        if block.tail is None:
            return
        siblings = self.tails[block.tail[0]]
        del siblings[block.block_id]
        if not siblings:
            del self.tails[block.tail[0]]
        block.tail = None

    def _take(self, block_id: int, keep_cached: bool = False) -> int:
        block = self.blocks[block_id]
        self._drop_tail(block)  # its slots are the taker's now (a scheduled copy out of it runs before they change)
        if block.ref_count == 0:
            del self.free_blocks[block_id]
            if not keep_cached and block.hash != NO_HASH:
                self._evict(block)
        block.ref_count += 1
        return block_id

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds returns to the free list, at the front unless it is cached."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"{block} freed twice"
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.hash == NO_HASH and block.tail is None:
                self.free_blocks.move_to_end(block_id, last=False)

    def _evict(self, block: Block) -> None:
        self.prefix_cache_evictions += 1
        copies = self.hash_to_blocks[block.hash]
        del copies[block.block_id]
        if not copies:
            del self.hash_to_blocks[block.hash]
        block.hash, block.key = NO_HASH, None

    def _publish(self, seq: Sequence, index: int) -> None:
        block = self.blocks[seq.block_table[index]]
        if block.hash != NO_HASH:
            return  # reached through a cache hit: already published
        parent = self.blocks[seq.block_table[index - 1]].hash if index > 0 else root_hash(seq.cache_salt, seq.lora_key)
        tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
        block.key = (parent, tokens)
        block.hash = hash_block(tokens, parent)
        self.hash_to_blocks.setdefault(block.hash, {})[block.block_id] = None


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    """How many leading tokens a and b share: a slot's K and V depend only on the tokens up to it."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
