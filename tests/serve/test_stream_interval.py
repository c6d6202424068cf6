"""What a generation costs in messages between the serving processes: a non-streamed choice reaches the ingress as
one Delta, and a stream with `stream_interval: k` goes out as its first token alone, then chunks of at least k
tokens, k the server's or, where larger, the request's own (vLLM's field). The text is the same whichever way it
travels."""
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine import SamplingParams
from serve_app.protocol import Admitted, GenerationJob
from tests.serve.conftest import ingress_only_app

pytestmark = pytest.mark.slow
MAX_TOKENS = 23
CHAT = {"messages": [{"role": "user", "content": "Name some colours."}], "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "stream": True}


def replica_messages(replica_handle, stream_interval: int | None) -> list:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    job = GenerationJob(f"interval-{stream_interval}", "Colours: red, green,", params, n=2,
                        stream_interval=stream_interval)
    return list(replica_handle.options(stream=True).generate.remote(job))


def test_a_non_streamed_choice_reaches_the_ingress_as_one_delta_with_the_whole_text(serve_app, replica_handle):
    admitted, *deltas = replica_messages(replica_handle, None)
    assert isinstance(admitted, Admitted)
    assert sorted(d.index for d in deltas) == [0, 1]
    assert all(d.finish_reason == "length" and d.completion_tokens == MAX_TOKENS for d in deltas)
    streamed = replica_messages(replica_handle, 1)[1:]
    # one a step per choice (2 x MAX_TOKENS), less those coalesced while the reader was behind: over half remain
    assert len(streamed) > MAX_TOKENS
    for whole in deltas:
        assert "".join(d.text for d in streamed if d.index == whole.index) == whole.text


def chunk_tokens(base: str, auth: dict, **extra) -> tuple[list[int], str]:
    """Tokens per SSE chunk that carries any (counted by their logprobs), and the streamed text."""
    counts, text = [], ""
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**CHAT, **extra}, headers=auth,
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            tokens = len((choice.get("logprobs") or {}).get("content") or [])
            if tokens:
                counts.append(tokens)
                text += choice["delta"].get("content") or ""
    return counts, text


def test_a_stream_interval_sends_the_first_token_alone_then_chunks_of_that_many(serve_app, replica_handle, auth):
    every_token, expected_text = chunk_tokens(serve_app["base_url"], auth)
    own_3, own_3_text = chunk_tokens(serve_app["base_url"], auth, stream_interval=3)  # the request's, above the 1
    with ingress_only_app(serve_app, replica_handle, "interval4", stream_interval=4) as base:
        counts, text = chunk_tokens(base, auth)
        below, _ = chunk_tokens(base, auth, stream_interval=2)  # raised to the server's 4
        above, _ = chunk_tokens(base, auth, stream_interval=6)
    assert text == expected_text == own_3_text
    assert sum(counts) == sum(every_token) == sum(own_3) == sum(below) == sum(above) == MAX_TOKENS
    for least, chunks in ((4, counts), (3, own_3), (4, below), (6, above)):
        assert chunks[0] == 1  # the first token never waits
        assert all(count >= least for count in chunks[1:-1]), (least, chunks)  # the end goes out whatever is left
        assert len(chunks) <= 1 + -(-(MAX_TOKENS - 1) // least) < len(every_token)


def test_an_adaptive_interval_streams_every_token_alone_and_coalesces_when_streams_share_the_replica(
        serve_app, replica_handle, auth):
    """stream_chunks_per_step 1: chunks of one token per stream open on the replica, up to stream_interval 8."""
    every_token, expected_text = chunk_tokens(serve_app["base_url"], auth)
    with ingress_only_app(serve_app, replica_handle, "adaptive", stream_interval=8, stream_chunks_per_step=1) as base:
        alone, text = chunk_tokens(base, auth)
        alone_own_3, _ = chunk_tokens(base, auth, stream_interval=3)  # no adapted interval below the request's
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda _: chunk_tokens(base, auth), range(4)))
    assert text == expected_text and all(t == expected_text for _, t in together)  # fp32: the batch changes nothing
    assert len(alone) > MAX_TOKENS // 2, alone  # one stream: every token goes (a few coalesced if the reader lags)
    assert alone_own_3[0] == 1 and all(count >= 3 for count in alone_own_3[1:-1]), alone_own_3
    assert all(sum(counts) == MAX_TOKENS and counts[0] == 1 for counts, _ in together), together
    # four open streams: chunks of 4 tokens (8 a stream); a stream admitted a step late, or left last, may send a
    # chunk or two at a smaller interval; every token alone would be about 4 x 23
    assert sum(len(counts) for counts, _ in together) <= 4 * (2 + -(-(MAX_TOKENS - 1) // 3)), together
