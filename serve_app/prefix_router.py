"""Serve's request router for engine replicas under `request_router: prefix_affinity`.

A generation goes to the replica that was sent the longest start of its prompt, where that start most likely still
sits in the replica's prefix cache, so a conversation's turns and the choices of one system prompt stay on one
replica's blocks. Among several such replicas, and whenever no start is known well enough or the holder is busier
than the least busy replica by more than `max_load_gap`, Serve's power of two choices decides; a holder whose queue
is full is passed over by Serve's own queue check, the pair after it tried.

As Ray Serve LLM's PrefixCacheAffinityRouter, but its prefix tree lives in a detached actor that every routing call
waits on; this index lives in the routing process (the ingress replica), so a decision costs no Ray call. Ingress
replicas share what they routed through the deployment's PrefixLog actor every `share_period_s`, so a conversation
whose turns reach different ingress replicas still finds the replica holding its history.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import ray
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # Serve's default, reused as such
from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from serve_app.prefix_affinity import (PrefixAffinityOptions, PrefixIndex, PrefixLog, Route, affinity_key,
                                      prefix_log_name)
from serve_app.protocol import GenerationJob

logger = logging.getLogger("ray.serve")


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    # no FIFOMixin: a replica chosen for one request's prefix must not be handed to an older request

    def initialize_state(self, **options: Any) -> None:
        self._options = PrefixAffinityOptions(**options)
        self._index = PrefixIndex(self._options.chunk_chars, self._options.max_chunks)
        self._name = uuid.uuid4().hex  # this router's routes in the shared log
        self._unshared: list[Route] = []
        self._unshared_chunks = 0
        self._sharing: asyncio.Task | None = None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if self._sharing is None:  # the first call on the router's event loop
            self._sharing = asyncio.get_running_loop().create_task(self._share_forever())
        pair = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        hashes = self._hashes(pending_request)
        if not pair or not hashes:
            return pair
        holders = self._holders(hashes, candidate_replicas)
        return [holders, *pair] if holders else pair

    def _hashes(self, pending_request: PendingRequest | None) -> list[int] | None:
        """A generation's chunk hashes, computed once and carried on the request (routing may retry; recording
        follows); None for any other call (stats, tokenize), which power of two choices routes."""
        if pending_request is None:
            return None
        if not hasattr(pending_request, "prefix_hashes"):
            job = pending_request.args[0] if pending_request.args else None
            key = affinity_key(job) if isinstance(job, GenerationJob) else None
            pending_request.prefix_hashes = self._index.chunk_hashes(key) if key else None
        return pending_request.prefix_hashes

    def _holders(self, hashes: list[int], candidates: list[RunningReplica]) -> list[RunningReplica]:
        """The replicas sent the longest known start of a key, if it is long enough and they are not overloaded."""
        by_id = {replica.replica_id.to_full_id_str(): replica for replica in candidates}
        matched, holders = self._index.longest_match(hashes, by_id)
        if not holders or matched < self._options.min_match_share * len(hashes):
            return []
        loads = {rid: self._replica_queue_len_cache.get(replica.replica_id) for rid, replica in by_id.items()}
        least = min((load for load in loads.values() if load is not None), default=0)
        return [by_id[rid] for rid in sorted(holders)
                if loads[rid] is None or loads[rid] - least <= self._options.max_load_gap]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hashes = self._hashes(pending_request)
        if hashes:
            self._index.record(hashes, replica_id.to_full_id_str())
            if self._unshared_chunks + len(hashes) <= self._options.max_chunks:  # past it, kept here only
                self._unshared.append((replica_id.to_full_id_str(), hashes))
                self._unshared_chunks += len(hashes)

    async def _share_forever(self) -> None:
        """Send this router's new routes to the shared log and learn the other routers' (those to live replicas),
        the first time at once: that exchange starts the log actor, which takes seconds, so waiting a period first
        left an app's first turns routed without the other ingress replicas' routes."""
        log, cursor = None, 0
        while True:
            routes, self._unshared, self._unshared_chunks = self._unshared, [], 0
            try:
                log = log or self._shared_log()
                news, cursor = await log.exchange.remote(self._name, routes, cursor)
            except Exception as exc:  # the log died with its owner: the next exchange makes a new one
                logger.warning("prefix routes not shared: %s", type(exc).__name__)
                log = None
            else:
                live = {replica_id.to_full_id_str() for replica_id in self._replica_id_set}
                for replica, hashes in news:
                    if replica in live:
                        self._index.record(hashes, replica)
            await asyncio.sleep(self._options.share_period_s)

    def _shared_log(self) -> ray.actor.ActorHandle:
        # owned by the first ingress replica to ask, so it ends with the app; if that replica goes first, the next
        # exchange anywhere creates a fresh one
        name = prefix_log_name(self._deployment_id.app_name, self._deployment_id.name)
        return ray.remote(PrefixLog).options(name=name, namespace="serve", get_if_exists=True, num_cpus=0).remote(
            self._options.max_chunks)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id.to_full_id_str())

