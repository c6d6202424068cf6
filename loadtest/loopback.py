"""A server on this machine's loopback: a free port to start it on, and the wait until it answers /health."""
from __future__ import annotations

import socket
import subprocess
import time

import httpx
from tqdm.auto import tqdm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None, what: str = "the server") -> None:
    """Poll /health until it answers 200; give up at the timeout, or at once if the server's process has exited."""
    deadline = time.monotonic() + timeout
    with tqdm(desc=f"waiting for {what}", bar_format="{desc}: {elapsed}") as bar:
        while not _healthy(url):
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise RuntimeError(f"{what} at {url} did not become healthy")
            time.sleep(0.5)
            bar.update()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
