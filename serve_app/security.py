"""Who may call what: the key (bearer or x-api-key) on every route but /health, and no unauthenticated exposure by
accident."""
from __future__ import annotations

import hmac
import ipaddress
import re
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.errors import OpenAIError, route_path

PUBLIC_PATHS = frozenset({"/health"})
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class Guard:
    """The bearer key on every route but /health, under any route prefix, and the request's id (the client's
    X-Request-Id when it is sane; Serve's proxy echoes it on every response). Pure ASGI: Starlette's
    BaseHTTPMiddleware passed every streamed chunk through a memory stream and a task of its own."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        incoming = headers.get("x-request-id", "")
        scope.setdefault("state", {})["request_id"] = incoming if REQUEST_ID.match(incoming) else f"req-{uuid.uuid4().hex}"
        if self.api_key and needs_key(scope) and not authorized(headers, self.api_key):
            refusal = OpenAIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' (or, as "
                                  "Anthropic's clients do, 'x-api-key: <key>')", code="invalid_api_key")
            return await refusal.response(scope)(scope, receive, send)
        await self.app(scope, receive, send)


def needs_key(scope: Scope) -> bool:
    return route_path(scope) not in PUBLIC_PATHS


def authorized(headers: Headers, key: str) -> bool:
    """The key as a bearer token, or in x-api-key (Anthropic's clients send it there); compared in constant time."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(token.strip().encode(), key.encode())
    return "x-api-key" in headers and hmac.compare_digest(headers["x-api-key"].strip().encode(), key.encode())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or 0.0.0.0-style wildcard: assume reachable from elsewhere


def exposure_problem(host: str | None, api_key: str | None, allow_unauthenticated: bool) -> str | None:
    """Why this app must not start: bound beyond loopback with no key, unless the operator said so on purpose."""
    if api_key or allow_unauthenticated or (host is not None and is_loopback(host)):
        return None
    where = f"on {host}" if host is not None else "on an address that could not be read"
    return (f"Serve's HTTP proxy listens {where}, which is reachable from other machines, and no api_key is set. "
            "Set api_key (or LLM_SERVE_API_KEY), bind 127.0.0.1, or set allow_unauthenticated: true if a gateway in "
            "front of it authenticates.")
