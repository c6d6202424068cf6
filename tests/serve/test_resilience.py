"""Disconnects, overload and a replica crash: nothing hangs, nothing leaks, accepted work completes."""
import asyncio
import json
import logging
import os
import signal
import time

import httpx
import pytest

from serve_app.protocol import ReplicaStats
from tests.conftest import nproc
from loadtest.loopback import wait_healthy

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)
LONG = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}], "max_tokens": 256,
        "stream": True}


async def idle_within(handle, timeout_s: float) -> tuple[ReplicaStats, float]:
    """The replica's stats once nothing runs or waits and every KV block is free, and the seconds that took; fails
    after `timeout_s` (conftest's wait_idle, for a test already in an event loop)."""
    start = time.monotonic()
    while not (stats := await handle.stats.remote()).engine.idle:
        assert time.monotonic() - start < timeout_s, stats
        await asyncio.sleep(0.02)
    return stats, time.monotonic() - start


async def test_fifty_clients_cut_off_mid_stream_free_every_block(base_url, auth, replica_handle):
    async def cut_off(client):
        async with client.stream("POST", base_url + "/v1/chat/completions", json=LONG, headers=auth) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    return  # leaving the block closes the connection mid-stream

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
        await asyncio.gather(*(cut_off(client) for _ in range(50)))
    _, seconds = await idle_within(replica_handle, 10)
    log.warning("blocks of 50 cut-off streams freed in %.3f s", seconds)
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}, headers=auth)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


async def test_clients_that_give_up_on_whole_completions_free_every_block(base_url, auth, replica_handle):
    """A whole completion whose client goes is aborted, not generated to its max_tokens for nobody: behind HAProxy
    that needs the client's close to reach the replica (haproxy_fence.py drops `option splice-request` for it)."""
    clients, body = 8, {**LONG, "stream": False, "ignore_eos": True}
    before = (await replica_handle.stats.remote()).engine.generation_tokens
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as client:
        posts = [asyncio.create_task(client.post(base_url + "/v1/chat/completions", json=body, headers=auth))
                 for _ in range(clients)]
        start = time.monotonic()
        while (await replica_handle.stats.remote()).engine.num_running < clients:
            assert time.monotonic() - start < 30 and not any(p.done() for p in posts), "never all running"
            await asyncio.sleep(0.02)
        for post in posts:
            post.cancel()  # mid-request: httpx closes the connection
        await asyncio.gather(*posts, return_exceptions=True)
    stats, seconds = await idle_within(replica_handle, 5)
    generated = stats.engine.generation_tokens - before
    log.warning("%d abandoned whole completions: idle %.3f s later, %d tokens", clients, seconds, generated)
    assert generated < clients * body["max_tokens"] / 2, generated  # aborted, not run to their end


async def test_clients_that_leave_during_admission_leave_no_generation_behind(base_url, auth, replica_handle):
    """A client that closes its connection while its request is being admitted (tens of ms after sending it)
    cancels the replica's call while the request sits in an admission batch, which enqueues it anyway: such
    requests ran to max_tokens for nobody (one in four, closing 40 ms after sending, on a 2-core Zen 4)."""
    body = json.dumps({**LONG, "ignore_eos": True}).encode()
    host, port = base_url.removeprefix("http://").split(":")
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
               + f"Authorization: {auth['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    before = (await replica_handle.stats.remote()).engine.generation_tokens
    delays_ms = range(20, 85, 5)  # across the admission window, wherever this machine's falls
    for delay_ms in delays_ms:
        for _ in range(4):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            await asyncio.sleep(delay_ms / 1000)
            writer.close()
    stats, _ = await idle_within(replica_handle, 60)
    generated = stats.engine.generation_tokens - before
    log.warning("%d clients gone during admission: %d tokens generated", 4 * len(delays_ms), generated)
    # one request run to its end is max_tokens alone; each of the others stops within a step or two of its abort (52
    # clients took 140 tokens in all on a 2-core Zen 4 in bf16, where more reach the engine than on slower CPUs)
    assert generated < LONG["max_tokens"], generated


async def test_a_burst_beyond_capacity_gets_200s_and_429s_only(base_url, auth):
    """BENCHMARKS claims no 5xx under a burst: overload is the engine's own 429, never a 503."""
    # ignore_eos: this raw (untemplated) prompt makes the model stop at once, which hid nothing but proved nothing
    body = {"prompt": "Tell me a joke.", "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def one(client):
        r = await client.post(base_url + "/v1/completions", json=body, headers=auth)
        return r.status_code, r.headers.get("retry-after"), r.json()

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=500)) as client:
        results = await asyncio.gather(*(one(client) for _ in range(400)))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert statuses.count(429) > 0, "the burst was meant to overflow the engine queue"
    for status, retry_after, body_ in results:
        if status == 200:
            assert body_["usage"]["completion_tokens"] == 16 and body_["choices"][0]["finish_reason"] == "length"
        else:
            assert retry_after is not None and "error" in body_
    log.warning("burst of 400: %d ok, %d 429", statuses.count(200), statuses.count(429))


def test_the_replica_steps_on_every_core_despite_rays_one_thread_default(replica_handle):
    stats = replica_handle.stats.remote().result(timeout_s=10)
    assert stats.engine.loop_threads == nproc() > 1, stats  # Ray sets OMP_NUM_THREADS=1 in every worker


def test_zz_a_killed_engine_core_fails_only_its_requests_and_serve_replaces_the_replica(base_url, auth, replica_handle):
    """Runs last in this module: it kills the shared app's engine core process, with a stream in flight on it. The
    replica's health check then fails, and Serve replaces the replica (a killed replica actor takes its core with
    it: tests/engine/test_core_process.py)."""
    stats = replica_handle.stats.remote().result(timeout_s=10)
    replica_id, core_pid = stats.placement.replica_id, stats.engine.core_pid
    with httpx.stream("POST", base_url + "/v1/chat/completions", json={**LONG, "ignore_eos": True}, headers=auth,
                      timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        killed_at = time.monotonic()
        os.kill(core_pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed_at < 5, "the stream must end as soon as its core is gone"
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] is None and "retry" in error["message"], error
    for internal in ("Traceback", "Actor", "actor_id", "ray.", "127.0.0.1", "File \""):
        assert internal not in error["message"], f"{internal!r} leaked to the client: {error['message']}"
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 5}, headers=auth, timeout=60)
    assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text)  # until Serve replaces it
    saw_outage = False
    while time.monotonic() - killed_at < 60 and not saw_outage:
        saw_outage = httpx.get(base_url + "/health", timeout=5).status_code == 503
        time.sleep(0.1)
    assert saw_outage, "/health never reported the dead core"
    wait_healthy(base_url, timeout=300)
    log.warning("engine core killed; /health healthy again after %.1f s", time.monotonic() - killed_at)
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True},
                   headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert replica_handle.stats.remote().result(timeout_s=10).placement.replica_id != replica_id, "Serve replaced it"
