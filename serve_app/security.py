"""Who may call what: the bearer key on every route but /health, and no unauthenticated exposure by accident."""
from __future__ import annotations

import hmac
import ipaddress

from starlette.types import Scope

PUBLIC_PATHS = frozenset({"/health"})


def route_path(scope: Scope) -> str:
    """The path as the app's routes see it. Under a Serve route_prefix the ASGI path still carries the prefix
    (it is in root_path too), so a check on the raw path would miss every route of a prefixed app."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


def needs_key(scope: Scope) -> bool:
    return route_path(scope) not in PUBLIC_PATHS


def authorized(authorization: str, key: str) -> bool:
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


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
