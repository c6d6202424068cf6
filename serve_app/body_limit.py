"""A request body cap that holds whether the size is announced (Content-Length) or streamed (chunked)."""
from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.errors import OpenAIError


class BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body parsing passes it on instead of turning it into a 400."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body is over the limit of {max_bytes} bytes")


class BodyLimit:
    """Pure ASGI, so the refusal is an OpenAI envelope (Starlette's own limit answers in plain text)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = OpenAIError(413, BodyTooLarge(self.max_bytes).detail).response()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await refusal(scope, receive, send)
        received, started = 0, False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if started:
                raise
            await refusal(scope, receive, send)
