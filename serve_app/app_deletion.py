"""Whether this replica's Serve application is being deleted, asked of Serve's controller at most once a second.

During `serve.delete`, Serve stops a split app's engine replicas at once but keeps its ingress reachable for the
draining period (30 s behind HAProxy), and its router holds a request for a deployment with no running replica
until one starts, which during a deletion none will. A request that reached the ingress then waited until the
ingress was killed."""
from __future__ import annotations

import asyncio
import time

CHECK_INTERVAL_S = 1.0


class AppDeletion:
    def __init__(self):
        self._checked_at = float("-inf")
        self._deleting = False
        self._asking: asyncio.Future | None = None  # one question in flight, shared by every waiting request

    async def deleting(self) -> bool:
        if self._deleting or time.monotonic() - self._checked_at < CHECK_INTERVAL_S:
            return self._deleting
        if self._asking is None:
            self._asking = asyncio.ensure_future(asyncio.to_thread(_app_is_being_deleted))
            self._asking.add_done_callback(self._answered)
        try:
            return await asyncio.shield(self._asking)
        except Exception:  # no answer is no reason to refuse: the request waits on, as it would have
            return False

    def _answered(self, asking: asyncio.Future) -> None:
        self._asking, self._checked_at = None, time.monotonic()
        self._deleting = not asking.cancelled() and asking.exception() is None and asking.result()


def _app_is_being_deleted() -> bool:
    """serve.status() blocks on the controller: called on a thread."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    app = serve.status().applications.get(serve.get_replica_context().app_name)
    return app is None or app.status == ApplicationStatus.DELETING
