"""A deadline for request headers in Ray Serve's HTTP proxy (and each replica's own HTTP server), against slowloris.

Uvicorn 0.54, which Serve runs there, starts no timer on a new connection, and a byte of data cancels its keep-alive
timer, so a client that sends its headers a byte at a time holds a connection, a file descriptor and a little memory
for as long as it likes; a few thousand such clients exhaust the proxy for everyone. Serve offers no setting for it,
but calls `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` once in each of those processes when it starts (meant for
middlewares, which only see complete requests), so `proxy_middlewares` arms a timer on each connection there instead.
"""
from __future__ import annotations

import asyncio
import os

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_ENV = "LLM_SERVE_HEADER_TIMEOUT_S"
DEFAULT_HEADER_TIMEOUT_S = 10.0  # nginx allows 60 s, Apache's mod_reqtimeout 20 s; a client on loopback needs ms


def header_timeout_s() -> float:
    return float(os.environ.get(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S))


def proxy_middlewares() -> list:
    """Serve's proxy callback: installs the deadline, adds no middleware."""
    install(header_timeout_s())
    return []


def install(timeout_s: float) -> None:
    """Every request's headers must be complete within timeout_s of its connection opening, or of the previous
    response ending plus the keep-alive timeout; otherwise the connection is closed."""
    for protocol in (HttpToolsProtocol, H11Protocol):
        if getattr(protocol, "_header_timeout_s", None) is None:
            _patch(protocol)
        protocol._header_timeout_s = timeout_s


def _patch(protocol: type) -> None:
    connection_made, on_response_complete = protocol.connection_made, protocol.on_response_complete

    def connection_made_with_deadline(self, transport: asyncio.Transport) -> None:
        connection_made(self, transport)
        _arm(self, self._header_timeout_s)

    def on_response_complete_with_deadline(self) -> None:
        on_response_complete(self)
        _arm(self, self._header_timeout_s + self.timeout_keep_alive)

    protocol.connection_made = connection_made_with_deadline
    protocol.on_response_complete = on_response_complete_with_deadline


def _arm(connection, delay_s: float) -> None:
    previous = getattr(connection, "_header_deadline", None)
    if previous is not None:
        previous.cancel()
    connection._header_deadline = connection.loop.call_later(delay_s, _expire, connection)


def _expire(connection) -> None:
    """A request whose headers arrived is the app's to bound (body_timeout_s, request_timeout_s); otherwise the
    connection is waiting on headers, or idle past keep-alive, and goes."""
    serving = connection.cycle is not None and not connection.cycle.response_complete
    if not serving and not connection.transport.is_closing():
        connection.transport.close()
