"""`topology: colocated`: the ingress and the engine replica in one Serve replica (serve_app/colocated.py). The same
fp32 engine settings as the session's split app, so greedy answers must match it token for token, but for sampling
defaults over the model's (greedy, 3 tokens), which only requests that leave those fields unset meet."""
import asyncio
import json

import httpx
import pytest

from tests.serve.conftest import wait_idle, whole_app
from tests.serve.test_hostile_input import assert_echo_attack_leaves_streams_flowing

pytestmark = pytest.mark.slow
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0}
SAMPLING_DEFAULTS = {"top_k": 1, "max_new_tokens": 3, "temperature": 0.5}  # vLLM's --override-generation-config


@pytest.fixture(scope="module")
def colocated(serve_app):
    from ray import serve

    engine_config = {**serve_app["args"]["engine_config"], "override_generation_config": SAMPLING_DEFAULTS}
    with whole_app(serve_app, "colocated", topology="colocated", engine_config=engine_config) as base:
        yield base, serve.get_deployment_handle("EngineIngress", app_name="colocated")


def test_one_deployment_serves_what_the_split_app_serves(colocated, base_url, auth):
    from ray import serve

    base, handle = colocated
    deployments = serve.status().applications["colocated"].deployments
    assert set(deployments) == {"EngineIngress"}, deployments  # no second hop: no EngineReplica of its own
    split = httpx.post(base_url + "/v1/chat/completions", json=CHAT, headers=auth, timeout=60)
    together = httpx.post(base + "/v1/chat/completions", json=CHAT, headers=auth, timeout=60)
    assert split.status_code == together.status_code == 200, together.text
    assert together.json()["choices"][0]["message"] == split.json()["choices"][0]["message"]
    assert together.json()["usage"] == split.json()["usage"]

    with httpx.stream("POST", base + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == split.json()["choices"][0]["message"]["content"]
    embed = {"input": ["Name three colours.", "Red"], "encoding_format": "float"}
    split_vectors = httpx.post(base_url + "/v1/embeddings", json=embed, headers=auth, timeout=60).json()["data"]
    together_vectors = httpx.post(base + "/v1/embeddings", json=embed, headers=auth, timeout=60).json()["data"]
    for one, other in zip(together_vectors, split_vectors, strict=True):  # fp32, batched as the steps fell
        assert max(abs(a - b) for a, b in zip(one["embedding"], other["embedding"], strict=True)) < 1e-4
    rerank = {"query": "Name three colours.", "documents": ["Red", "Seven", "Blue and green"]}
    split_ranks = httpx.post(base_url + "/v1/rerank", json=rerank, headers=auth, timeout=60).json()["results"]
    together_ranks = httpx.post(base + "/v1/rerank", json=rerank, headers=auth, timeout=60).json()["results"]
    assert [r["index"] for r in together_ranks] == [r["index"] for r in split_ranks]
    wait_idle(handle)


def test_the_models_sampling_defaults_fill_what_a_request_leaves_unset(colocated, auth):
    """vLLM's generation config defaults, served: greedy and 3 new tokens for requests that set neither, through
    the Responses API too; a request's own fields win."""
    base, handle = colocated
    messages = [{"role": "user", "content": "Name three colours."}]
    with httpx.Client(base_url=base, headers=auth, timeout=120) as client:
        def chat(**fields) -> dict:
            reply = client.post("/v1/chat/completions", json={"messages": messages, **fields})
            assert reply.status_code == 200, reply.text
            return reply.json()

        defaulted, greedy = chat(), chat(temperature=0.0, max_tokens=3)
        assert defaulted["usage"]["completion_tokens"] == 3
        assert defaulted["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
        response = client.post("/v1/responses", json={"input": "Name three colours."}).json()
        assert response["usage"]["output_tokens"] == 3
        assert response["output"][0]["content"][0]["text"] == greedy["choices"][0]["message"]["content"]
        assert (response["temperature"], response["top_p"]) == (0.5, 1.0)  # as sampled
        chosen = client.post("/v1/responses", json={"input": "Hi", "temperature": 0.0, "max_output_tokens": 2}).json()
        assert (chosen["temperature"], chosen["usage"]["output_tokens"]) == (0.0, 2)
        assert chat(max_tokens=6, ignore_eos=True)["usage"]["completion_tokens"] == 6  # the request's own
    wait_idle(handle)


def test_every_route_but_health_needs_the_key(colocated, auth):
    base, _ = colocated
    assert httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 401
    assert httpx.get(base + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(base + "/v1/models", headers=auth, timeout=30).json()["data"][0]["max_model_len"] > 0
    assert httpx.get(base + "/health", timeout=30).json()["status"] == "ok"


def running_when_the_client_leaves(colocated, auth, path: str, body: dict, lines: int) -> int:
    """Requests the engine runs after `lines` lines of a stream, read just before the client hangs up."""
    base, handle = colocated
    with httpx.stream("POST", base + path, json=body, headers=auth, timeout=60) as r:
        for number, _ in enumerate(r.iter_lines()):
            if number == lines:
                return handle.stats.remote().result(timeout_s=10).engine.num_running
    raise AssertionError(f"the stream ended within {lines} lines")


def test_a_client_that_goes_away_frees_its_blocks(colocated, auth):
    """The stream is cancelled in this process, not by a Ray message: the engine must still abort it."""
    _, handle = colocated
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    assert running_when_the_client_leaves(colocated, auth, "/v1/chat/completions", body, lines=4) == 1
    stats = wait_idle(handle)
    assert stats.engine.generation_tokens < 200 + 2 * CHAT["max_tokens"], stats  # aborted, not run to its end


def test_a_client_that_leaves_a_streamed_batch_of_prompts_aborts_every_prompt(colocated, auth):
    """A batch of prompts streams as one merged stream of three generations; here no Ray message carries the
    hang-up, so the merged stream itself must abort all three."""
    _, handle = colocated
    before = handle.stats.remote().result(timeout_s=10).engine.generation_tokens
    body = {"prompt": ["Once upon a time", "The capital of France is", "List three colours:"], "max_tokens": 200,
            "ignore_eos": True, "temperature": 0, "stream": True}
    assert running_when_the_client_leaves(colocated, auth, "/v1/completions", body, lines=6) == 3
    stats = wait_idle(handle)
    assert stats.engine.generation_tokens - before < 200, stats  # each aborted after a few tokens, none run to its end


async def test_the_echo_attack_leaves_another_clients_stream_flowing_here_too(colocated, auth):
    """One event loop here both renders the attack's megabytes of logprobs and feeds every other stream: the
    longest gap was 1.9-3.5 of the attack's mean steps here (BENCHMARKS.md, twenty-fifth session). One of the split
    app's four requests: its answer is still 5 MB rendered on this loop, its eight choices scored over many steps,
    and scoring two 4,090-token prompts in fp32 on two cores took 41 s of the suite (the split app's test, `long`,
    sends all four)."""
    base, handle = colocated
    await assert_echo_attack_leaves_streams_flowing(base, auth, handle, requests=1)
    await asyncio.to_thread(wait_idle, handle)  # its sync handle calls may not run on this event loop
