"""The environment Ray's processes start with: `ray start` (make serve, the load test, the cluster configs) and
the tests' own cluster read it from here. Ray Serve reads these variables when each of its processes starts, so they
belong to Ray's environment, not to the Serve config.

`python -m serve_app.ray_env [--python-proxy]` prints them as `NAME=value` words for a shell's `env`;
`python -m serve_app.ray_env start [--python-proxy]` starts a loopback head (as `make serve`) unless one runs.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

RAY_ENV = {
    # Ray starts workers at nice 15, and on a small box a nice-0 load generator or shell then starves the replicas
    # (2,720 against 7,720 req/h under Locust, BENCHMARKS.md)
    "RAY_worker_niceness": "0",
    # Ray's GCS, raylets, client server and dashboard agent listen on every interface whatever --node-ip-address
    # says, and every Serve replica binds its gRPC server to "[::]:0" (ray/serve/_private/replica.py:1835 in 2.60);
    # each runs code for whoever reaches it. With token auth each demands the cluster's bearer token.
    "RAY_AUTH_MODE": "token",
    # Serve calls this in its HTTP proxy and each replica's HTTP server when they start: a deadline for request
    # headers, which Serve's uvicorn never bounds (serve_app/header_deadline.py)
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "serve_app.header_deadline.proxy_middlewares",
}

# The default on a node started here (`make serve`; `PYTHON_PROXY=1` for Serve's Python proxy): Ray Serve's
# documented high-throughput mode. HAProxy (shipped with ray[serve] on Linux) takes the HTTP port in place of the
# Python proxy and forwards to the ingress replica's own HTTP server, and deployments talk gRPC. The Python proxy
# spends 7.7 ms of CPU a request where this mode spends 2.2, and at overload on 2 cores this mode served 0.92-1.02x
# vLLM's OpenAI server in the same run where the Python proxy served 0.82-0.94x (BENCHMARKS.md, 2026-11-26). A request
# sent while an app is deleted is served by its draining ingress, refused by it (serve_app/app_deletion.py) or
# answered 404 once HAProxy reloads; it hung before the split ingress learned to refuse. What Ray 2.60 renders open
# in HAProxy's config (no header deadline, the stats page and the exporter on every interface, plain-text errors) is
# closed by serve_app/haproxy_fence.py, which Ray runs in place of haproxy; its admin socket (mode 666) goes in a
# directory only this user may enter. Cluster nodes start Ray from cluster/, with RAY_ENV only: Serve's Python proxy.
THROUGHPUT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
HAPROXY_SOCKET_DIR = Path.home() / ".ray" / "haproxy-serve"
HAPROXY_FENCE = Path(sys.executable).parent / "llm-serve-haproxy"  # pyproject's console script, beside this python

LOCAL_HEAD = "127.0.0.1:6379"


def ray_env(throughput: bool = True) -> dict[str, str]:
    if not throughput:
        return dict(RAY_ENV)
    if not os.access(HAPROXY_FENCE, os.X_OK):
        raise FileNotFoundError(f"{HAPROXY_FENCE} is missing: install this project into {sys.prefix} (make setup)")
    HAPROXY_SOCKET_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    HAPROXY_SOCKET_DIR.chmod(0o700)
    return {**RAY_ENV, **THROUGHPUT_ENV, "RAY_SERVE_HAPROXY_SOCKET_PATH": str(HAPROXY_SOCKET_DIR / "admin.sock"),
            "RAY_SERVE_HAPROXY_BINARY_PATH": str(HAPROXY_FENCE)}


def ensure_auth_token() -> None:
    """Create Ray's default token file if no token is configured. Created here, not by `ray get-auth-token
    --generate`, because Ray writes it readable by every local user (0644) and this writes it 0600."""
    path = Path.home() / ".ray" / "auth_token"  # where Ray looks when neither variable is set
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or path.exists():
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(32))


def setdefault_ray_env(throughput: bool = True) -> None:
    """For a `ray.init` in this process, whose Ray processes inherit its environment; what is already set wins."""
    for name, value in ray_env(throughput).items():
        os.environ.setdefault(name, value)
    ensure_auth_token()
    if "ray._raylet" in sys.modules:  # Ray caches its config at import: re-read the auth mode, as ray.init's own
        from ray._raylet import Config  # token set-up does (ray/_private/authentication/authentication_token_setup.py)

        Config.initialize("")


def start_local_ray(throughput: bool = True) -> bool:
    """A head on loopback with metrics on 8080 (what `make serve` and the load test use), unless one already
    answers there; says whether it started one."""
    ray = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, **ray_env(throughput)}
    if subprocess.run([ray, "status", "--address", LOCAL_HEAD], capture_output=True, env=env).returncode == 0:
        return False
    ensure_auth_token()
    started = subprocess.run([ray, "start", "--head", "--node-ip-address=127.0.0.1", "--metrics-export-port=8080",
                              "--disable-usage-stats"], capture_output=True, text=True, env=env)
    if started.returncode != 0:
        raise RuntimeError(f"ray start failed:\n{started.stdout}{started.stderr}")
    return True


if __name__ == "__main__":
    throughput = "--python-proxy" not in sys.argv[1:]
    if "start" in sys.argv[1:]:
        start_local_ray(throughput)
    else:
        print(" ".join(f"{name}={value}" for name, value in ray_env(throughput).items()))
