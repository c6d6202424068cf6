"""RequestInbox: where callers' threads hand requests and aborts to the step loop, which takes them at the start of
each step; and every request in flight, by id. Torch-free; every method is thread-safe."""
from __future__ import annotations

import threading
from typing import Callable

from engine.admission import check_admission
from engine.sequence import Sequence


class RequestInbox:
    def __init__(self, max_waiting: int | None, num_scheduled_waiting: Callable[[], int]):
        self.max_waiting = max_waiting
        self._num_scheduled_waiting = num_scheduled_waiting  # the scheduler's queue counts against max_waiting too
        self._lock = threading.Lock()
        self._new: list[Sequence] = []
        self._aborts: list[tuple[str, str]] = []  # (request id, finish reason)
        self._in_flight: dict[str, Sequence] = {}

    def put(self, seq: Sequence, prompt_leader: str | None = None) -> None:
        """EngineInputError for an id already in flight, EngineOverloadedError past max_waiting."""
        with self._lock:
            check_admission(seq.request_id, self._in_flight, self.num_waiting, self.max_waiting)
            seq.prompt_leader = self._in_flight.get(prompt_leader) if prompt_leader is not None else None
            self._in_flight[seq.request_id] = seq
            self._new.append(seq)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        with self._lock:
            self._aborts.append((request_id, reason))

    def take(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """The requests added since the last call, and the unfinished ones aborted since then (new ones included)
        with the reason they end, each once however often it was aborted (the first reason given)."""
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            reasons: dict[str, str] = {}
            for request_id, reason in aborts:
                reasons.setdefault(request_id, reason)
            aborted = [(self._in_flight.get(request_id), reason) for request_id, reason in reasons.items()]
        return new, [(seq, reason) for seq, reason in aborted if seq is not None and not seq.is_finished]

    def finished(self, request_id: str) -> None:
        with self._lock:
            self._in_flight.pop(request_id, None)

    @property
    def has_pending(self) -> bool:
        return bool(self._new or self._aborts)

    @property
    def num_waiting(self) -> int:
        """Requests not yet taken plus those the scheduler holds waiting."""
        return len(self._new) + self._num_scheduled_waiting()
