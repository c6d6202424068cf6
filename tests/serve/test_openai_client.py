"""The official `openai` client against the real app under Ray Serve (fp32 engine, embedded model)."""
import asyncio
import time

import openai
import pytest

from engine import SamplingParams

from tests.engine.helpers import NEAR_TIE

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=serve_app["base_url"] + "/v1", api_key=serve_app["api_key"], max_retries=0, timeout=120)


@pytest.fixture
def aclient(serve_app):  # per test: an async client is bound to its event loop
    return openai.AsyncOpenAI(base_url=serve_app["base_url"] + "/v1", api_key=serve_app["api_key"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The same engine offline, fp32: what greedy answers through HTTP must equal."""
    from engine import LLM

    return LLM(dtype="float32", num_kv_blocks=512)


def test_models_lists_the_served_model_with_its_context(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].max_model_len == 8192


def test_retrieving_the_served_model_gives_its_object_and_any_other_id_a_404_naming_it(client):
    assert client.models.retrieve(MODEL).model_dump() == client.models.list().data[0].model_dump()
    for other in ("gpt-4o", "HuggingFaceTB/SmolLM2-135M-Instruct"):  # a Hugging Face id, slash and all
        with pytest.raises(openai.NotFoundError) as refused:
            client.models.retrieve(other)
        error = refused.value.body
        assert error["code"] == "model_not_found" and error["param"] == "model" and other in error["message"]


def test_each_served_model_name_is_listed_accepted_and_echoed(serve_app, replica_handle):
    """vLLM's --served-model-name with several names: any of them is the model, the first is listed first."""
    from tests.serve.conftest import ingress_only_app

    with ingress_only_app(serve_app, replica_handle, "aliases", served_model_name=[MODEL, "smol"]) as base:
        aliased = openai.OpenAI(base_url=base + "/v1", api_key=serve_app["api_key"], max_retries=0, timeout=120)
        assert [m.id for m in aliased.models.list().data] == [MODEL, "smol"]
        for name in (MODEL, "smol"):
            reply = aliased.completions.create(model=name, prompt="Hello", max_tokens=2, temperature=0)
            assert reply.model == name and reply.usage.completion_tokens == 2
        with pytest.raises(openai.NotFoundError) as refused:
            aliased.completions.create(model="smol2", prompt="Hello", max_tokens=2)
        assert f"this server serves '{MODEL}' or 'smol'" in refused.value.body["message"]


def test_chat_completion_with_usage_matching_the_tokenizer(client, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    (expected,) = offline.chat([messages], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop" == expected.finish_reason
    assert r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)  # the engine's own ids, EOS included


def test_completion_without_model_field_and_length_finish(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10 and r.choices[0].text


BATCH = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


def test_a_batch_of_prompts_answers_each_in_order_with_n_choices_each(client, offline, tokenizer):
    """OpenAI's completions take a list of prompts (lm-evaluation-harness sends them so): choice k * n + i is prompt
    k's choice i, usage sums the prompts, and token lists give what their texts give."""
    expected = offline.generate(BATCH, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt=BATCH, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [e.text for e in expected for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert r.usage.completion_tokens == 6 * 8
    ids = client.completions.create(model=MODEL, prompt=[tokenizer.encode(p) for p in BATCH], max_tokens=8, temperature=0)
    assert [c.text for c in ids.choices] == [e.text for e in expected]
    echoed = client.completions.create(model=MODEL, prompt=BATCH, max_tokens=8, temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == [p + e.text for p, e in zip(BATCH, expected)]


def test_a_streamed_batch_of_prompts_gives_each_choice_its_own_text_and_usage_sums_them(client, offline):
    expected = offline.generate(BATCH, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    stream = client.completions.create(model=MODEL, prompt=BATCH, max_tokens=8, temperature=0, n=2, stream=True,
                                       stream_options={"include_usage": True})
    texts, finished, usage = [""] * 6, [None] * 6, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason or finished[choice.index]
        usage = chunk.usage or usage
    assert texts == [e.text for e in expected for _ in range(2)] and finished == ["length"] * 6
    assert usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected) and usage.completion_tokens == 48


def test_a_client_leaving_a_streamed_batch_aborts_every_prompts_requests(client, replica_handle):
    """Each prompt of the batch is its own generation; hanging up aborts them all at once, not as each would end
    (256 tokens: seconds here)."""
    stream = client.completions.create(model=MODEL, prompt=BATCH, max_tokens=256, temperature=0, n=2, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices and first.choices[0].index in range(6)
    stream.close()
    deadline = time.monotonic() + 2.0
    while (running := replica_handle.stats.remote().result().engine.num_running) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_with_one_bad_prompt_is_refused_whole_naming_the_prompt(client, stream):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=["Once upon a time", ""], max_tokens=200, stream=stream)
    assert refused.value.body["param"] == "prompt", refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=["hi"] * 65, max_tokens=1, stream=stream)
    assert refused.value.body["param"] == "prompt" and "at most 64 prompts" in refused.value.body["message"]


def test_streaming_chat_first_chunk_well_before_the_last(client):
    start = time.monotonic()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=120, temperature=0, stream=True, stream_options={"include_usage": True})
    arrivals, text, usage = [], "", None
    for chunk in stream:
        arrivals.append(time.monotonic() - start)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert len(arrivals) > 5 and arrivals[0] < arrivals[-1] / 3, arrivals
    assert usage is not None and usage.completion_tokens == 120 and text


def test_streaming_completion(client):
    chunks = list(client.completions.create(model=MODEL, prompt="The sea is", max_tokens=16, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)


def test_same_seed_same_text(client):
    def sample():
        return client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=24,
                                         temperature=1.0, seed=1234).choices[0].text

    assert sample() == sample()


async def test_sixteen_identical_greedy_requests_agree(aclient):
    async def one():
        r = await aclient.completions.create(model=MODEL, prompt="List three fruits:", max_tokens=32, temperature=0)
        return r.choices[0].text

    answers = await asyncio.gather(*(one() for _ in range(16)))
    assert len(set(answers)) == 1


async def test_thirty_two_different_prompts_get_their_own_answers(aclient, offline):
    import torch

    from engine import SamplingParams

    prompts = [f"Write one sentence about the number {i} and the colour {c}." for i, c in
               zip(range(32), ["red", "green", "blue", "gold"] * 8)]

    async def one(p):
        return await aclient.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)

    responses = await asyncio.gather(*(one(p) for p in prompts))
    expected = offline.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    tok = offline.inputs.tokenizer
    for prompt, response, want in zip(prompts, responses, expected):
        assert response.usage.prompt_tokens == len(tok.encode(prompt))
        got_text = response.choices[0].text
        if got_text == want.text:
            continue
        # allowed only at a near-tie: find the first differing token and compare the offline logprobs there
        got_ids = tok.encode(got_text, add_special_tokens=False)
        k = next(i for i, (a, b) in enumerate(zip(got_ids, want.token_ids)) if a != b)
        ids = torch.tensor([want.prompt_token_ids + want.token_ids[:k]])
        from tests.engine.helpers import load_hf_model
        logprobs = torch.log_softmax(load_hf_model(MODEL)(ids).logits[0, -1].float(), -1)
        assert abs(float(logprobs[got_ids[k]] - logprobs[want.token_ids[k]])) < NEAR_TIE, (prompt, got_text, want.text)
