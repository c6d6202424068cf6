"""A second app of its own under a route prefix (bf16, the default dtype), so the shared one keeps serving:
auth under a non-root prefix, then graceful shutdown."""
import asyncio
import json
import logging
import time

import httpx
import pytest

from loadtest.loopback import wait_healthy

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)
MAX_TOKENS = 192  # with ignore_eos: long enough to be in flight when draining starts


async def read_stream(client: httpx.AsyncClient, url: str, headers: dict, started: asyncio.Event) -> dict:
    body = {"messages": [{"role": "user", "content": "Count to one hundred."}], "max_tokens": MAX_TOKENS,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chunks = []
    async with client.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: "):])
                started.set()
    return {"done": chunks[-1] == "[DONE]", "events": [json.loads(c) for c in chunks[:-1]]}


@pytest.fixture(scope="module")
def drain_app(serve_app):
    from ray import serve

    from serve_app.app import build_app

    args = {**serve_app["args"], "engine_config": {**serve_app["args"]["engine_config"], "dtype": "auto"}, "graceful_shutdown_timeout_s": 60}
    serve.run(build_app(args), name="drain", route_prefix="/drain", blocking=False)
    base = serve_app["base_url"] + "/drain"
    wait_healthy(base, 300)
    yield base
    if "drain" in serve.status().applications:
        serve.delete("drain")


@pytest.mark.parametrize("method, route", [("GET", "/v1/models"), ("GET", "/v1/models/any"), ("GET", "/openapi.json"),
                                           ("GET", "/version"),
                                           ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                           ("GET", "/no/such/route")])
def test_under_a_route_prefix_every_route_but_health_needs_the_key(drain_app, auth, method, route):
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 2} if method == "POST" else None
    refused = httpx.request(method, drain_app + route, json=body, timeout=30)
    assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"], refused.text
    assert httpx.request(method, drain_app + route, json=body, headers=auth, timeout=60).status_code in (200, 404)
    assert httpx.get(drain_app + "/health", timeout=30).status_code == 200


async def test_shutdown_lets_in_flight_streams_finish_and_refuses_new_ones(drain_app, auth):
    from ray import serve

    url = drain_app + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        smoke = await client.post(url, headers=auth, json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})
        assert smoke.status_code == 200 and smoke.json()["usage"]["completion_tokens"] >= 1  # the bf16 default serves

        started = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(read_stream(client, url, auth, s)) for s in started]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        began = time.monotonic()
        deleting = asyncio.create_task(asyncio.to_thread(serve.delete, "drain"))
        refused = await first_refusal(client, url, auth, deadline_s=60)  # draining observed, not assumed after a sleep
        in_flight_when_refused = sum(not s.done() for s in streams)
        results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        await asyncio.wait_for(deleting, 120)
        log.warning("shutdown drained 4 in-flight streams in %.1f s; a new request meanwhile got %d",
                    time.monotonic() - began, refused.status_code)

    assert in_flight_when_refused == 4, "streams ended before draining began: the drain was not tested"
    for result in results:
        assert result["done"], "a stream was cut off by the shutdown"
        assert not any("error" in e for e in result["events"]), result["events"]
        assert result["events"][-1]["usage"]["completion_tokens"] == MAX_TOKENS


async def first_refusal(client: httpx.AsyncClient, url: str, headers: dict, deadline_s: float) -> httpx.Response:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        r = await client.post(url, headers=headers, timeout=10,
                              json={"messages": [{"role": "user", "content": "late"}], "max_tokens": 1})
        if r.status_code != 200:
            assert r.status_code in (404, 503), r.text
            return r
        await asyncio.sleep(0.1)
    raise AssertionError(f"no request was refused within {deadline_s} s of the shutdown")
