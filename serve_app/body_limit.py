"""A request body cap that holds whether the size is announced (Content-Length) or streamed (chunked), and a
deadline for the whole body, so a client that trickles bytes (slow-loris) cannot hold a request open for ever."""
from __future__ import annotations

import asyncio
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.errors import OpenAIError


class BodyRefused(HTTPException):
    """An HTTPException, so FastAPI's body parsing passes it on instead of turning it into a 400."""


def too_large(max_bytes: int) -> BodyRefused:
    return BodyRefused(413, f"request body is over the limit of {max_bytes} bytes")


def too_slow(timeout_s: float) -> BodyRefused:
    return BodyRefused(408, f"request body did not arrive within {timeout_s:g} s")


class BodyLimit:
    """Pure ASGI, so the refusal is an OpenAI envelope (Starlette's own limit answers in plain text)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(too_large(self.max_bytes), scope, receive, send)
        deadline = time.monotonic() + self.timeout_s
        received, body_done, started = 0, False, False

        async def counted_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body, receive() only waits for a disconnect: no deadline then
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise too_slow(self.timeout_s) from None
            received += len(message.get("body", b""))
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if received > self.max_bytes:
                raise too_large(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyRefused as refusal:
            if started:
                raise
            await self._refuse(refusal, scope, receive, send)

    @staticmethod
    async def _refuse(refusal: BodyRefused, scope: Scope, receive: Receive, send: Send) -> None:
        await OpenAIError(refusal.status_code, refusal.detail).response(scope)(scope, receive, send)
