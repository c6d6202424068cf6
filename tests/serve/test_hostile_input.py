"""Hostile and odd input through real HTTP under Ray Serve: nothing a client sends gets a 5xx or hurts another
request, and the limits hold."""
import asyncio
import json
import logging
import sys
import time
import uuid

import httpx
import pytest

from engine.config import EngineConfig
from engine.step_stats import heap_frozen_during
from serve_app.protocol import ReplicaStats

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat(content="Say hello.", **changes):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, **changes}


async def test_a_poisoned_request_beside_five_ordinary_ones_fails_none_of_them(base_url, auth):
    bodies = [chat(temperature=1e-40, ignore_eos=True)] + [chat(ignore_eos=True, seed=i) for i in range(5)]
    async with httpx.AsyncClient(timeout=120) as client:
        replies = await asyncio.gather(*(client.post(base_url + CHAT, json=b, headers=auth) for b in bodies))
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8 and reply.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("raw_body, param", [
    (b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 4}', "messages[0].content"),
    (b'{"prompt": "\\udfff", "max_tokens": 4}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"], "max_tokens": 4}', "stop[0]"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800", "max_tokens": 4}', "model"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\ud800", "max_tokens": 4}', "user"),
])
def test_text_that_is_not_unicode_is_a_400_naming_the_field(base_url, auth, raw_body, param):
    path = COMPLETIONS if b'"prompt"' in raw_body else CHAT
    r = httpx.post(base_url + path, content=raw_body, headers={**auth, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "unicode" in error["message"].lower(), error


@pytest.mark.parametrize("body, param, words", [
    (chat(seed=2**64), "seed", "64-bit"),
    (chat(seed=-(2**63) - 1), "seed", "64-bit"),
    (chat(stop=["x" * 257]), "stop", "256 characters"),
    (chat(max_tokens=257), "max_tokens", "at most 256"),
    (chat(max_completion_tokens=10**30), "max_tokens", "at most 256"),
    (chat(cache_salt=""), "cache_salt", ""),
    (chat(messages=[{"role": "user", "content": "hi"}] * 5000), None, ""),  # a huge array: refused, not a 5xx
])
def test_absurd_values_are_400s_naming_the_field(base_url, auth, body, param, words):
    r = httpx.post(base_url + CHAT, json=body, headers=auth, timeout=60)
    assert r.status_code in (400, 413) and r.status_code < 500, r.text
    if param is not None:
        error = r.json()["error"]
        assert r.status_code == 400 and param in (error["param"] or "") and words in error["message"], error


def test_a_prompt_that_cannot_fit_is_refused_by_its_length_before_tokenizing(base_url, auth):
    started = time.monotonic()
    r = httpx.post(base_url + COMPLETIONS, json={"prompt": "a" * 700_000, "max_tokens": 4}, headers=auth, timeout=60)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "prompt"
    assert time.monotonic() - started < 5


async def test_a_body_that_trickles_in_times_out_with_408(base_url, serve_app):
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write((f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {serve_app['api_key']}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{").encode())
    await writer.drain()
    started = time.monotonic()

    async def trickle():
        while True:
            await asyncio.sleep(0.5)
            writer.write(b" ")
            await writer.drain()

    dripping = asyncio.create_task(trickle())
    try:
        status_line = await asyncio.wait_for(reader.readline(), 30)
    finally:
        dripping.cancel()
        writer.close()
    waited = time.monotonic() - started
    assert status_line.split()[1] == b"408", status_line
    assert serve_app["args"]["body_timeout_s"] - 0.5 <= waited < 20, waited


async def seconds_until_the_server_hangs_up(base_url: str, drip: bytes | None,
                                            limit_s: float = 30) -> tuple[float, bytes]:
    """Opens a connection, sends the start of a request, then `drip` every half second (nothing when None); the
    seconds until the server closed it, and what it sent before closing."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\n".encode() if drip else b"")
    started = time.monotonic()

    async def dribble():
        while drip:
            await asyncio.sleep(0.5)
            writer.write(drip)
            await writer.drain()

    dribbling = asyncio.create_task(dribble())
    try:
        answer = await asyncio.wait_for(reader.read(), limit_s)
        # Serve's Python proxy hangs up (serve_app/header_deadline.py); HAProxy answers its own 408 and closes
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    finally:
        dribbling.cancel()
        writer.close()
    return time.monotonic() - started, answer


@pytest.mark.parametrize("drip", [b"X-Slow: 1\r\n", None], ids=["headers-a-line-at-a-time", "nothing-at-all"])
async def test_a_client_slow_with_its_headers_is_cut_off_at_the_header_deadline(base_url, serve_app, drip):
    """Slowloris (issue 41 item 6): Serve's proxy waited forever for headers, so each such client held a connection
    and a descriptor (against main this test waits out its 30 s limit); serve_app/header_deadline.py closes it in
    Serve's Python proxy (LLM_TEST_PYTHON_PROXY=1), serve_app/haproxy_fence.py's `timeout http-request` in HAProxy."""
    deadline = serve_app["header_timeout_s"]
    waited, _ = await seconds_until_the_server_hangs_up(base_url, drip)
    assert deadline - 0.5 <= waited < deadline + 3


def test_the_header_deadline_spares_keep_alive_connections(base_url, auth, serve_app):
    with httpx.Client(base_url=base_url, headers=auth, timeout=30) as client:
        assert client.get("/v1/models").status_code == 200
        time.sleep(serve_app["header_timeout_s"] + 0.5)  # idle past the deadline, inside keep-alive
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/models").status_code == 200
        assert len(client._transport._pool.connections) == 1, "the idle connection was closed and replaced"


def test_openapi_schema_is_published_behind_the_key(base_url, auth):
    assert httpx.get(base_url + "/openapi.json", timeout=30).status_code == 401
    schema = httpx.get(base_url + "/openapi.json", headers=auth, timeout=30).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(schema["paths"])


def test_a_stream_waiting_for_its_first_token_gets_keep_alive_comments(base_url, auth, serve_app):
    body = {"prompt": "word " * 3000, "max_tokens": 2, "stream": True}  # a prefill of seconds on this CPU
    lines = []
    with httpx.stream("POST", base_url + COMPLETIONS, json=body, headers=auth, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                lines.append(line)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data > 0 and all(line == ": keep-alive" for line in lines[:first_data]), lines[:5]
    assert lines[-1] == "data: [DONE]" and not any("error" in line for line in lines), [l for l in lines if "error" in l][:2]


def test_a_cache_salt_keeps_prefix_cache_blocks_apart(base_url, auth, replica_handle):
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 12  # ~130 tokens, unseen

    def hits_after(salt):
        before = replica_handle.stats.remote().result(timeout_s=10).engine.prefix_cache_hits
        body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        assert httpx.post(base_url + COMPLETIONS, json=body, headers=auth, timeout=60).status_code == 200
        return replica_handle.stats.remote().result(timeout_s=10).engine.prefix_cache_hits - before

    tenant_a, tenant_b = (f"{name}-{uuid.uuid4().hex}" for name in ("tenant-a", "tenant-b"))  # salts no test used
    assert hits_after(tenant_a) == 0
    assert hits_after(tenant_b) == 0, "another tenant's salt must not hit tenant-a's blocks"
    # Unsalted, the prompt may share its first token or few with an earlier test's freed unsalted tail (any prompt
    # starting as it does: the uuid's first piece), a legitimate hit; tenant-a's ~130 tokens would be 8 full blocks
    assert hits_after(None) < EngineConfig().block_size, "an unsalted request must not hit (or time) a salted prompt"
    assert hits_after(tenant_a) >= 100, "the same salt shares its blocks"


def test_tool_call_arguments_nested_past_the_parsers_depth_are_kept_as_text_not_a_500(base_url, auth):
    """An assistant turn's `arguments` nested past the interpreter's recursion limit: json.loads raises
    RecursionError (not JSONDecodeError), which was a 500. Now the string goes to the template as the client sent it.
    (No deeper than needed: each bracket is a prompt token to prefill.)"""
    depth = sys.getrecursionlimit() + 500
    deep = "[" * depth + "]" * depth
    with pytest.raises(RecursionError):
        json.loads(deep)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = httpx.post(base_url + CHAT, json={"messages": messages, "tools": tools, "max_tokens": 4}, headers=auth, timeout=120)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert "context" in r.json()["error"]["message"], r.text


def ref_chain(depth: int, at: str = "#") -> dict:
    """A JSON schema whose $refs chain `depth` deep in flat text (3 objects a link): each link is a level of
    llguidance's recursive compile. `at`: where the schema sits in the document its pointers resolve in."""
    defs = {f"r{i}": {"anyOf": [{"$ref": f"{at}/$defs/r{i + 1}"}, {"const": i}]} for i in range(depth)}
    defs[f"r{depth}"] = {"const": "end"}
    return {"$defs": defs, "$ref": f"{at}/$defs/r0"}


async def test_constraints_that_recurse_deep_in_the_compiler_leave_a_stream_beside_them_whole(base_url, auth):
    """llguidance compiles on its caller's stack: a schema whose $refs chained 1,500 deep, or a Lark rule chain
    3,000 deep, overflowed a thread's 8 MB, and the process that checked or compiled it (the replica, or its core)
    died of a segfault with every stream in it. Each attack here did; now each compiles on a larger stack, fails at
    its first token on llguidance's per-token limits (a 400 naming its field: it was a 500), and the stream beside
    them ends whole."""
    lark = "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x"\n' for i in range(3000)) + 'r3000: "y"\n'
    # a forced call's grammar embeds the arguments' schema at /properties/arguments (engine/tool_calls.py)
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(3000, "#/properties/arguments")}}
    attacks = {"response_format": chat(response_format={"type": "json_schema",
                                                        "json_schema": {"name": "deep", "schema": ref_chain(3000)}}),
               "structured_outputs.grammar": chat(structured_outputs={"grammar": lark}),
               # the tools' text overflows the context, refused after its grammar is checked (that check crashed)
               "prompt": chat(tools=[deep_tool], tool_choice="required")}
    async with httpx.AsyncClient(timeout=120) as client:
        async def watched_stream() -> str:
            body = {**chat(max_tokens=64, ignore_eos=True), "stream": True}
            async with client.stream("POST", base_url + CHAT, json=body, headers=auth) as r:
                return "".join([line async for line in r.aiter_lines()])

        stream = asyncio.ensure_future(watched_stream())
        await asyncio.sleep(0.5)
        for field, body in attacks.items():  # each compiles, then meets the parser's limits at its first token
            r = await client.post(base_url + CHAT, json=body, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert field == "prompt" or "parser limits" in r.json()["error"]["message"], r.text
        text = await stream
    assert text.endswith("[DONE]") and '"error"' not in text, text[-300:]
    too_many = chat(response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": ref_chain(3400)}})
    r = httpx.post(base_url + CHAT, json=too_many, headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


async def stream_gaps_while(base_url: str, auth: dict, attack) -> tuple[list[float], list]:
    """The gaps between another client's streamed chunks while `attack(client)` runs, and the attack's replies.
    That client streams from 1 s before the attack to its first chunk after the attack's end, one request after
    another (gaps counted within each), so all of the attack is watched however long it takes on this CPU.
    Chunks are not counted: a replica sends what is ready as one chunk, so a loop a step behind sends fewer, fuller
    ones, and the longest gap is what the client waits. The client's own heap is frozen meanwhile: pytest's full
    collections (0.2-0.3 s, seen while the attack's answers arrive) would read as the server's gaps."""
    with heap_frozen_during():
        return await _stream_gaps_while(base_url, auth, attack)


async def _stream_gaps_while(base_url: str, auth: dict, attack) -> tuple[list[float], list]:
    attack_over = asyncio.Event()
    async with httpx.AsyncClient(timeout=300) as client:
        async def chunk_times() -> list[float]:
            times = []
            async with client.stream("POST", base_url + CHAT, json=chat(max_tokens=250, ignore_eos=True, stream=True),
                                     headers=auth) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.monotonic())
                        if attack_over.is_set():  # the gap across the attack's end is in: hang up
                            break
            return times

        async def watch() -> list[float]:
            gaps = []
            while not attack_over.is_set():
                times = await chunk_times()
                gaps += [later - earlier for earlier, later in zip(times, times[1:])]
            return gaps

        watching = asyncio.create_task(watch())
        await asyncio.sleep(1.0)
        try:
            replies = await attack(client)
        finally:
            attack_over.set()
        return await watching, replies


def distinct_schema(i: int) -> dict:
    """A legitimate schema that takes llguidance about 0.15 s to compile on this CPU, unique to `i`."""
    row = {"type": "object", "properties": {f"q{i}_{j}": {"type": "string", "pattern": "[a-z]{2,9}"} for j in range(30)}}
    return {"type": "object", "properties": {f"p{i}_{k}": {"type": "array", "items": row} for k in range(30)}}


async def test_requests_with_new_schemas_do_not_stall_another_clients_stream(base_url, auth):
    """24 requests, each with a schema the core has not seen, while another client streams: the core compiles them
    on a thread of its own, and its steps leave that thread a core, so the stream's longest gap between chunks stays
    under 1 s. (The core used to compile them between steps, holding its loop for the sum of their compile times;
    then beside its steps on a shared core, where the longest gap was 0.16-0.75 s here and 1.01-1.16 s in CI's full
    runs, and 0.16-0.25 s since it gets a core of its own. The replica's own checks of the schemas still shared one
    with the step's threads: 0.53-0.90 s on an AMX Xeon, 1.07 s in CI; 0.14-0.29 s since steps leave a core to any
    process that wants one.)"""
    formats = [{"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": distinct_schema(i)}} for i in range(24)]

    async def attack(client):
        return await asyncio.gather(*(client.post(base_url + CHAT, json=chat(max_tokens=4, response_format=f),
                                                  headers=auth) for f in formats))

    start = time.monotonic()
    gaps, replies = await stream_gaps_while(base_url, auth, attack)
    log.warning("24 new schemas beside a stream: %.1f s, longest gap %.2f s", time.monotonic() - start - 1, max(gaps))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200][:2]
    assert max(gaps) < 1.0, f"{len(gaps)} gaps, longest {max(gaps):.2f} s"


@pytest.mark.long  # 60-80 s; test_colocated.py sends a quarter of it to the shipped topology in `make test`
async def test_echoed_prompts_scored_for_n_choices_do_not_stall_another_clients_stream(base_url, auth, replica_handle):
    """Issue 41 item 2's attack: 4 requests with `echo`, `logprobs` 5 and `n` 8 on 4,090-token prompts (each answer
    5 MB of JSON). The prompt is scored once for all n, in shares of an eighth of a step's budget, its scores cross
    to the ingress once, and the n - 1 other choices find its blocks in the prefix cache even where an older copy of
    them was evicted. Before those, the longest gap was 4.4-5.7 s, then 0.84-2.21 s (BENCHMARKS.md)."""
    await assert_echo_attack_leaves_streams_flowing(base_url, auth, replica_handle)


async def assert_echo_attack_leaves_streams_flowing(base_url: str, auth: dict, stats_handle, requests: int = 4) -> None:
    """The echo attack (`requests` of them) beside another client's stream, against the app at `base_url` whose
    engine `stats_handle` reports.

    The bar is counted in the engine's own mean step over the attack, so it holds whatever the CPU: issue 41's 1 s
    was about 5 steps on the AMX Xeon where it was set, and a slower CI machine's longest gap was 1.25 s. Since the
    watching client hangs up once the attack is over, the mean is the attack's own (0.25 s a step here, where the
    quiet steps after it had pulled it to 0.185); the longest gap was 1.9-3.5 of them, and 8 fail the 2.2-5.7 s
    stalls seen before the siblings copied their blocks."""
    prompts = [" ".join(f"w{i}x{j}" for j in range(700)) for i in range(requests)]

    async def attack(client):
        return await asyncio.gather(*(client.post(base_url + COMPLETIONS, headers=auth, json={
            "prompt": p, "echo": True, "logprobs": 5, "n": 8, "max_tokens": 4}) for p in prompts))

    before = await stats_handle.stats.remote()
    gaps, replies = await stream_gaps_while(base_url, auth, attack)
    mean_step_s = engine_seconds_per_step(before, await stats_handle.stats.remote())
    log.warning("echo attack: longest gap %.2f s, %.1f mean steps of %.3f s", max(gaps), max(gaps) / mean_step_s, mean_step_s)
    assert all(r.status_code == 200 for r in replies), [r.text[:200] for r in replies if r.status_code != 200][:2]
    scored = replies[0].json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(scored) > 4000, len(scored)
    assert max(gaps) < 8 * mean_step_s, \
        f"{len(gaps)} gaps, longest {max(gaps):.2f} s, mean engine step {mean_step_s:.3f} s"


def engine_seconds_per_step(before: ReplicaStats, after: ReplicaStats) -> float:
    """The engine's mean step time between two of its stats, every phase counted."""
    seconds = sum(after.engine.step_seconds.values()) - sum(before.engine.step_seconds.values())
    return seconds / (after.engine.num_steps - before.engine.num_steps)
