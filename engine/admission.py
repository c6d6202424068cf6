"""The one admission rule, for every place that takes a request in: the front end's output processor, the process
core's handle and the core's own inbox all call it, so they cannot disagree. Torch-free."""
from __future__ import annotations

from collections.abc import Container

from engine.errors import EngineInputError, EngineOverloadedError


def check_admission(request_id: str, in_flight: Container[str], num_waiting: int = 0,
                    max_waiting: int | None = None) -> None:
    """EngineInputError (naming request_id) for an id already in flight; EngineOverloadedError (a 429 when served)
    when `num_waiting` requests not yet running already reach `max_waiting`."""
    if request_id in in_flight:
        raise EngineInputError(f"request id {request_id!r} is already in flight", "request_id")
    if max_waiting is not None and num_waiting >= max_waiting:
        raise EngineOverloadedError(f"the engine queue is full ({max_waiting} waiting requests)")
