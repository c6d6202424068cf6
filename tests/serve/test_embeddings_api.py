"""`POST /v1/embeddings` on the real app under Ray Serve, through the official `openai` client (which asks for base64)
and plain HTTP (floats): each input's vector is the offline engine's, in order, whatever the batch; every refused
field is a 400 naming it."""
import asyncio
import base64
import contextlib
import re
import time

import httpx
import numpy as np
import openai
import pytest

from tests.engine.test_embeddings import TEXTS
from tests.serve.conftest import wait_idle

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4  # the served engine and the offline one, both fp32, in other batch shapes


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=serve_app["base_url"] + "/v1", api_key=serve_app["api_key"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(llm32):
    return lambda inputs, **pooling: np.array([o.embedding for o in llm32.embed(inputs, use_tqdm=False, **pooling)])


def post(base_url, auth, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/embeddings", json=body, headers=auth, timeout=120)


def test_the_openai_client_gets_each_inputs_embedding_in_order(client, offline, tokenizer):
    inputs = TEXTS * 20  # 100 inputs: more than a job runs at once, so they come back through the window in order
    r = client.embeddings.create(model=MODEL, input=inputs)
    assert r.object == "list" and r.model == MODEL and [d.index for d in r.data] == list(range(len(inputs)))
    got = np.array([d.embedding for d in r.data])
    assert got.shape == (100, 576)
    assert np.abs(got - np.tile(offline(TEXTS), (20, 1))).max() < TOLERANCE
    assert r.usage.prompt_tokens == r.usage.total_tokens == 20 * sum(len(tokenizer.encode(t)) for t in TEXTS)


def test_floats_base64_and_token_id_inputs_agree(base_url, auth, offline, tokenizer):
    ids = [tokenizer.encode(t) for t in TEXTS[:3]]
    floats = post(base_url, auth, {"input": TEXTS[:3], "encoding_format": "float"}).json()
    encoded = post(base_url, auth, {"input": ids, "encoding_format": "base64"}).json()
    big = post(base_url, auth, {"input": TEXTS[0], "encoding_format": "base64", "endianness": "big"}).json()
    want = offline(TEXTS[:3])
    assert np.abs(np.array([d["embedding"] for d in floats["data"]]) - want).max() < TOLERANCE
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in encoded["data"]])
    assert np.abs(decoded - want).max() < TOLERANCE
    assert np.abs(np.frombuffer(base64.b64decode(big["data"][0]["embedding"]), dtype=">f4") - want[0]).max() < TOLERANCE
    assert floats["usage"]["prompt_tokens"] == encoded["usage"]["prompt_tokens"] == sum(map(len, ids))
    single = post(base_url, auth, {"input": ids[0], "encoding_format": "float"}).json()  # one token list
    assert len(single["data"]) == 1 and np.abs(np.array(single["data"][0]["embedding"]) - want[0]).max() < TOLERANCE


def test_vllms_truncation_and_raw_hidden_states(base_url, auth, offline, tokenizer):
    from engine import PoolingParams

    cut = post(base_url, auth, {"input": TEXTS[2], "truncate_prompt_tokens": 10, "encoding_format": "float"}).json()
    assert cut["usage"]["prompt_tokens"] == 10
    assert np.abs(np.array(cut["data"][0]["embedding"]) - offline([tokenizer.encode(TEXTS[2])[-10:]])[0]).max() < TOLERANCE
    raw = post(base_url, auth, {"input": TEXTS[0], "use_activation": False, "encoding_format": "float"}).json()
    want = offline([TEXTS[0]], pooling_params=PoolingParams(normalize=False))[0]
    assert np.linalg.norm(want) > 2 and np.abs(np.array(raw["data"][0]["embedding"]) - want).max() < 1e-3


@pytest.mark.parametrize("body, param, words", [
    ({"input": "hi", "dimensions": 64}, "dimensions", "Matryoshka"),
    ({"input": ""}, "input", "empty"),
    ({"input": ["ok", ""]}, "input", "empty"),
    ({"input": []}, "input", ""),
    ({"input": ["a"] * 2049}, "input", "2048"),
    ({"input": [[1, 2], [49152]]}, "input", "vocabulary"),
    ({"input": [1] * 9000}, "input", "context"),
    ({"input": "hi", "encoding_format": "bytes"}, "encoding_format", ""),
    ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages", "chat"),
    ({"input": "hi", "embed_dtype": "float16"}, "embed_dtype", "float32"),
    ({"input": "hi", "truncation_side": "right"}, "truncation_side", "right"),
    ({"input": "hi", "add_special_tokens": False}, "add_special_tokens", ""),
    ({"input": "hi", "priority": 3}, "priority", "fcfs"),
])
def test_refusals_name_the_field(base_url, auth, body, param, words):
    r = post(base_url, auth, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_another_model_is_a_404_and_no_key_a_401(base_url, auth):
    r = post(base_url, auth, {"input": "hi", "model": "text-embedding-3-small"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert post(base_url, {}, {"input": "hi"}).status_code == 401


# What each field of the README's table is sent as: a value that exercises it (for refused fields, one refused)
EXAMPLES = {
    "model": {"model": MODEL}, "input": {"input": ["one", "two"]}, "encoding_format": {"encoding_format": "base64"},
    "dimensions": {"dimensions": 576}, "user": {"user": "u1"}, "truncate_prompt_tokens": {"truncate_prompt_tokens": 2},
    "use_activation": {"use_activation": False}, "endianness": {"endianness": "big", "encoding_format": "base64"},
    "request_id": {"request_id": "mine-2"}, "priority": {"priority": 0}, "embed_dtype": {"embed_dtype": "bfloat16"},
    "truncation_side": {"truncation_side": "right"}, "padding": {"padding": "max_length"},
    "add_special_tokens": {"add_special_tokens": False}, "messages": {"messages": [{"role": "user", "content": "x"}]},
    "mm_processor_kwargs": {"mm_processor_kwargs": {"size": 1}}, "cache_salt": {"cache_salt": "tenant-a"},
    "chat_template": {"chat_template": "{{ messages }}"}, "chat_template_kwargs": {"chat_template_kwargs": {"a": 1}},
    "add_generation_prompt": {"add_generation_prompt": True}, "continue_final_message": {"continue_final_message": True},
    "media_io_kwargs": {"media_io_kwargs": {"image": {}}},
}


def embedding_table() -> dict[str, str]:
    from tests.serve.test_openai_fields import README

    text = README.read_text()
    table = text[text.index("<!-- embedding-fields:start -->"):text.index("<!-- embedding-fields:end -->")]
    return {m[1]: m[2] for m in (re.match(r"^\| `(\w+)` \| (\w+) \|", line) for line in table.splitlines()) if m}


def test_the_table_lists_every_field_we_send():
    assert set(embedding_table()) == set(EXAMPLES)
    assert set(embedding_table().values()) == {"yes", "refused"}


@pytest.mark.parametrize("field,outcome", sorted(embedding_table().items()))
def test_each_field_gets_its_documented_outcome(base_url, auth, field, outcome):
    r = post(base_url, auth, {"input": "hello there", **EXAMPLES[field]})
    if outcome == "yes":
        assert r.status_code == 200 and r.json()["data"], (field, r.text)
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        assert field in r.json()["error"]["message"], r.text


def test_a_client_that_leaves_stops_its_embeddings(base_url, auth, replica_handle, tokenizer):
    """1,000 distinct inputs of 100 tokens are over a minute of work here: a client gone once the engine has begun
    on them leaves none of it running; the replica is idle with every block free soon after, having computed a part
    only. (It leaves on the engine's first computed tokens, not after a fixed two seconds: on a busy 2-core VM the
    request had not reached the engine by then, and nothing was left to stop.)"""
    before = wait_idle(replica_handle).engine.prompt_tokens
    inputs = [f"{i} " + TEXTS[4] for i in range(1000)]  # distinct: none comes from the prefix cache

    def computed() -> int:
        return replica_handle.stats.remote().result(timeout_s=10).engine.prompt_tokens - before

    async def leave_once_begun():
        async with httpx.AsyncClient(timeout=120) as http:
            call = asyncio.create_task(http.post(f"{base_url}/v1/embeddings", json={"input": inputs}, headers=auth))
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(computed) == 0:
                assert not call.done(), call.result().text[:300]
                assert time.monotonic() < deadline, "the engine began none of the inputs in 60 s"
                await asyncio.sleep(0.05)
            call.cancel()  # closes the connection: the client has left
            with contextlib.suppress(asyncio.CancelledError):
                await call

    asyncio.run(leave_once_begun())
    total = wait_idle(replica_handle).engine.prompt_tokens - before
    assert 0 < total < len(tokenizer.encode(inputs[0])) * len(inputs) / 4, total
