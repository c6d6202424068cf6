"""What prefix-affinity routing remembers: which engine replicas were sent which prompt starts.

A generation's affinity key is the text its KV blocks are computed from, in order: its cache salt (salted blocks are
never shared across salts), the tools offered (chat templates put them first), then the prompt or each chat message.
The key is cut into chunks whose hashes chain, as KV blocks' hashes do, so equal hashes mean equal starts. Pure logic:
no Ray, no torch.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from collections import OrderedDict, deque
from typing import Any, Iterable

from pydantic import BaseModel, ConfigDict, Field

from serve_app.protocol import GenerationJob


class PrefixAffinityOptions(BaseModel):
    """`request_router: prefix_affinity`'s knobs (AppArgs.prefix_affinity), passed to the router as its kwargs."""
    model_config = ConfigDict(extra="forbid")

    chunk_chars: int = Field(default=128, ge=16, description=(
        "the key is matched in chunks of this many characters (token ids count one each); about 32 tokens of "
        "English, two 16-token KV blocks"))
    max_chunks: int = Field(default=200_000, ge=1, description=(
        "chunks remembered per ingress process, least recently routed forgotten first (about 25 MB at the default)"))
    min_match_share: float = Field(default=0.1, ge=0, le=1, description=(
        "route by affinity only when the known start covers this share of the key's chunks (Ray Serve LLM's "
        "PrefixCacheAffinityRouter: 0.1 of its characters); below it, power of two choices"))
    max_load_gap: int = Field(default=20, ge=0, description=(
        "route by affinity only to a replica with at most this many more ongoing requests than the least busy "
        "one (the imbalance threshold of Ray Serve LLM's documented example: 20)"))
    share_period_s: float = Field(default=0.5, gt=0, description=(
        "every ingress replica sends what it routed to the deployment's PrefixLog and takes the others' this often, "
        "so a conversation whose turns reach different ingress replicas still finds its replica"))


def affinity_key(job: GenerationJob) -> str:
    """The text the job's prompt blocks follow from, such that a conversation's next turn extends its last's key."""
    parts = [f"salt:{job.cache_salt}\x00"] if job.cache_salt is not None else []
    if job.lora_name is not None:  # an adapter's prompt blocks serve that adapter only
        parts.append(f"lora:{job.lora_name}\x00")
    if job.tools:
        parts.append(json.dumps(job.tools, sort_keys=True) + "\x00")
    if isinstance(job.prompt, str):
        parts.append(job.prompt)
    elif job.prompt and isinstance(job.prompt[0], int):
        parts.append("".join(map(chr, job.prompt)))  # one character a token id: ids are below 0x110000
    else:
        parts.extend(_message_text(message) for message in job.prompt)
    return "".join(parts)


def _message_text(message: dict[str, Any]) -> str:
    # each message alone, so the messages of a turn serialise to a prefix of the next turn's
    return json.dumps(message, sort_keys=True, separators=(",", ":")) + "\x00"


class PrefixIndex:
    """Chained chunk hashes of routed keys, each with the replicas it went to, bounded least recently routed first."""

    def __init__(self, chunk_chars: int, max_chunks: int):
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._holders: OrderedDict[int, dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def chunk_hashes(self, key: str) -> list[int]:
        """One hash a whole chunk, each over its parent's: a partial last chunk is not counted, as a partial block."""
        hashes, parent, size = [], b"", self.chunk_chars
        for start in range(0, len(key) - size + 1, size):
            # not hash(): it is salted per process, and ingress replicas share these hashes
            chunk = key[start:start + size].encode("utf-8", "surrogatepass")
            parent = hashlib.blake2b(parent + chunk, digest_size=8).digest()
            hashes.append(int.from_bytes(parent, "little"))
        return hashes

    def longest_match(self, hashes: list[int], live: Iterable[str]) -> tuple[int, set[str]]:
        """How many leading chunks some live replica was sent, and which live replicas were sent all of them."""
        live = set(live)
        matched, holders = 0, set()
        for depth, chunk in enumerate(hashes):
            here = live.intersection(self._holders.get(chunk, ()))
            if not here:
                break
            matched, holders = depth + 1, here
        return matched, holders

    def record(self, hashes: list[int], replica: str) -> None:
        # deepest first, so a chain's start is its most recent entry and the bound forgets tails before heads
        for chunk in reversed(hashes):
            self._holders.setdefault(chunk, {})[replica] = None
            self._holders.move_to_end(chunk)
        while len(self._holders) > self.max_chunks:
            self._holders.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica gone: its cache with it."""
        for chunk, holders in list(self._holders.items()):
            holders.pop(replica, None)
            if not holders:
                del self._holders[chunk]


Route = tuple[str, list[int]]  # a replica and the chunk hashes of a key routed to it


def prefix_log_name(app_name: str, deployment_name: str) -> str:
    """The Ray actor name of a deployment's PrefixLog, in the "serve" namespace."""
    return f"PrefixLog:{app_name}:{deployment_name}"


class PrefixLog:
    """The routes every ingress replica of one deployment recorded, in order, so each can learn the others' (a Ray
    actor in serving, prefix_router.py). Bounded by chunks, oldest dropped first; a reader that fell behind the
    bound misses what was dropped, which costs it cache hits, never correctness."""

    def __init__(self, max_chunks: int):
        self.max_chunks = max_chunks
        self._routes: deque[tuple[int, str, Route]] = deque()  # sequence number, recording router, route
        self._last = 0
        self._chunks = 0

    def exchange(self, router: str, routes: list[Route], cursor: int) -> tuple[list[Route], int]:
        """Append `router`'s routes; return the other routers' routes after `cursor`, and the new cursor."""
        if cursor > self._last:
            cursor = 0  # a cursor this log never gave: its predecessor's, which died with its owner
        for route in routes:
            self._last += 1
            self._routes.append((self._last, router, route))
            self._chunks += len(route[1])
        while self._chunks > self.max_chunks:
            self._chunks -= len(self._routes.popleft()[2][1])
        first = self._routes[0][0] if self._routes else self._last + 1
        start = max(0, cursor + 1 - first)
        news = [route for _, source, route in itertools.islice(self._routes, start, None) if source != router]
        return news, self._last
