"""What a request sent during `serve.delete` gets: the app at /drain streams 4 chats, is deleted, and a probe every
0.1 s (1 token, 10 s read timeout) runs until one is refused; repeated for `--cycles`. HAProxy's access log, which
says where each request went and how it ended, goes to --haproxy-log (its syslog target, UDP 127.0.0.1:514; needs
root to bind).

PYTHONPATH=. python benchmarks/drain_probe.py [--cycles 5] [--topology split|colocated] [--python-proxy] [--port 8000]
"""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False)
API_KEY = "drain-probe-key"
LATE = {"messages": [{"role": "user", "content": "late"}], "max_tokens": 1}
STREAM = {"messages": [{"role": "user", "content": "Count to one hundred."}], "max_tokens": 192, "stream": True,
          "ignore_eos": True}


def capture_syslog(path: Path) -> None:
    """HAProxy logs to 127.0.0.1:514 over UDP; each datagram is written with its arrival time."""
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 514))

    def receive():
        with path.open("a") as log:
            while True:
                log.write(f"{time.time():.3f} {receiver.recv(65536).decode(errors='replace')}\n")
                log.flush()

    threading.Thread(target=receive, daemon=True).start()


async def stream(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> bool:
    async with client.stream("POST", url, json=STREAM, headers=auth()) as r:
        last = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = line
                started.set()
    return last == "data: [DONE]"


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


async def cycle(base: str, args: dict) -> dict:
    from ray import serve

    from loadtest.loopback import wait_healthy
    from serve_app.app import build_app

    serve.run(build_app(args), name="drain", route_prefix="/drain", blocking=False)
    wait_healthy(base + "/drain", 300)
    url = base + "/drain/v1/chat/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        assert (await client.post(url, headers=auth(), json=LATE)).status_code == 200
        started = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(stream(client, url, s)) for s in started]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        began = time.monotonic()
        deleting = asyncio.create_task(asyncio.to_thread(serve.delete, "drain"))
        probes = []  # (seconds after the deletion began, status or exception, seconds it took)
        while time.monotonic() - began < 60:
            sent = time.monotonic()
            try:
                status = (await client.post(url, headers=auth(), json=LATE, timeout=10)).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            probes.append((sent - began, status, time.monotonic() - sent))
            if status != 200:
                break
            await asyncio.sleep(0.1)
        finished = await asyncio.gather(*streams, return_exceptions=True)
        try:
            await asyncio.wait_for(deleting, 120)
            deleted = f"{time.monotonic() - began:.1f} s"
        except Exception as exc:
            deleted = type(exc).__name__
    return {"probes": probes, "streams": sum(f is True for f in finished), "deleted": deleted}


@app.command()
def main(cycles: int = 5, topology: str = "split", python_proxy: bool = False, port: int = 8000,
         haproxy_log: Path = Path("/tmp/drain-probe-haproxy.log")):
    import ray
    from ray import serve

    from serve_app.ray_env import setdefault_ray_env

    capture_syslog(haproxy_log)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    setdefault_ray_env(throughput=not python_proxy)
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = dict(engine_config=dict(dtype="auto", num_kv_blocks=1024, max_num_seqs=64, max_waiting=64,
                                   max_tokens_limit=256),
                api_key=API_KEY, request_timeout_s=60, graceful_shutdown_timeout_s=60, topology=topology)
    table = Table("cycle", "streams ended [DONE]", "last probes (s after delete, status, s taken)", "deleted in")
    try:
        for number in range(cycles):
            result = asyncio.run(cycle(f"http://127.0.0.1:{port}", args))
            last = ", ".join(f"({at:.2f}, {status}, {took:.2f})" for at, status, took in result["probes"][-3:])
            table.add_row(str(number), f"{result['streams']}/4", last, result["deleted"])
    finally:
        serve.shutdown()
        ray.shutdown()
    Console().print(table)
    print(f"HAProxy's log: {haproxy_log}")


if __name__ == "__main__":
    app()
