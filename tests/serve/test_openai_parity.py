"""The API surface real clients use, through the official `openai` client against the real app (fp32 engine):
content parts, tool turns, sampling extras, logprobs, n, echo, structured output and tool calls."""
import json

import jsonschema
import openai
import pytest

from engine import SamplingParams

from tests.engine.helpers import LOGPROB_TOLERANCE, load_hf_model, teacher_forced_logprobs

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                       "required": ["zone"], "additionalProperties": False}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 30}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=serve_app["base_url"] + "/v1", api_key=serve_app["api_key"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    from engine import LLM

    return LLM(dtype="float32", num_kv_blocks=512)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **{"temperature": 0, **kwargs})


def test_text_parts_are_joined_like_one_string(client):
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    as_parts = chat(client, [{"role": "user", "content": parts}], max_tokens=16)
    as_text = chat(client, [{"role": "user", "content": "What is the capital\nof France?"}], max_tokens=16)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


def test_a_tool_round_trip_renders_the_call_and_its_result(client, offline):
    messages = [*ASK_WEATHER,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = chat(client, messages, tools=[WEATHER_TOOL], max_tokens=24)
    ids = offline.inputs.tokenize(messages, [WEATHER_TOOL])
    text = offline.inputs.tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text and '"name": "get_time"' not in text
    assert r.usage.prompt_tokens == len(ids)


def test_top_k_one_is_greedy_and_min_tokens_holds_off_the_end(client):
    prompt = "The capital of France is"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    top1 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.5, seed=3,
                                     extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text
    short = chat(client, [{"role": "user", "content": "Say OK."}], max_tokens=40)
    long = chat(client, [{"role": "user", "content": "Say OK."}], max_tokens=40, extra_body={"min_tokens": 30})
    assert short.usage.completion_tokens < 30 <= long.usage.completion_tokens


def test_logit_bias_and_stop_token_ids(client, offline):
    prompt = "The capital of France is"
    (base,) = offline.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={str(base.token_ids[0]): -100})
    (expected,) = offline.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0,
                                                            logit_bias={base.token_ids[0]: -100}), use_tqdm=False)
    assert r.choices[0].text == expected.text != base.text
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"stop_token_ids": [base.token_ids[1]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 2


def test_repetition_penalty_matches_the_engine(client, offline):
    prompt = "one two one two one two one two"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"repetition_penalty": 1.5})
    (expected,) = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.5),
                                   use_tqdm=False)
    (plain,) = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert r.choices[0].text == expected.text != plain.text


def test_chat_logprobs_match_the_engine_and_rank_the_top_tokens(client, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = chat(client, messages, max_tokens=8, logprobs=True, top_logprobs=3)
    (expected,) = offline.chat([messages], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3), use_tqdm=False)
    content = r.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids) == r.usage.completion_tokens
    reference = teacher_forced_logprobs(load_hf_model(MODEL), expected.prompt_token_ids, expected.token_ids)
    for position, (entry, token, engine_entry) in enumerate(zip(content, expected.token_ids, expected.logprobs)):
        assert entry.logprob == pytest.approx(engine_entry[token], abs=1e-4)
        assert entry.logprob == pytest.approx(float(reference[position, token]), abs=LOGPROB_TOLERANCE)  # HF, fp32
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the top one
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    spelled = content[:-1] if r.choices[0].finish_reason == "stop" else content  # EOS has no text
    assert "".join(e.token for e in spelled) == r.choices[0].message.content


def test_completion_logprobs_have_offsets_into_the_text(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(top) <= 2 and max(top.values()) >= lp_ - 1e-6 for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs))


def test_streamed_logprobs_cover_every_token(client):
    stream = chat(client, [{"role": "user", "content": "Count to five."}], max_tokens=12, logprobs=True, stream=True)
    tokens = [e.token for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert len(tokens) == 12


def test_echo_returns_the_prompt_before_the_completion(client):
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                         echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_too(client, offline):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    (expected,) = offline.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1),
                                   use_tqdm=False)
    num_prompt = len(expected.prompt_token_ids)
    assert len(lp.tokens) == num_prompt + 3 and "".join(lp.tokens) == text and text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for position in range(1, num_prompt):
        token = expected.prompt_token_ids[position]
        assert lp.token_logprobs[position] == pytest.approx(expected.prompt_logprobs[position][token], abs=1e-4)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                         logprobs=1, stream=True)
    tokens = [t for chunk in streamed if chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_echo_with_logprobs_and_n_scores_the_prompt_once_for_every_choice(client, replica_handle):
    """Only the first choice scores the prompt; the others share its blocks (prefix hits) and its scores."""
    prompt = "An echo test prompt scored once for three choices: " + "the river bends around the mill " * 10
    before = replica_handle.stats.remote().result()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, seed=3, n=3, echo=True,
                                  logprobs=1, extra_body={"ignore_eos": True})
    after = replica_handle.stats.remote().result()
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    prompt_len = r.usage.prompt_tokens
    scores = [(c.logprobs.tokens[:prompt_len], c.logprobs.token_logprobs[:prompt_len]) for c in r.choices]
    assert scores[0] == scores[1] == scores[2] and scores[0][1][0] is None and None not in scores[0][1][1:]
    assert all(len(c.logprobs.tokens) == prompt_len + 4 and c.text.startswith(prompt) for c in r.choices)
    full_blocks = (prompt_len - 1) // 16 * 16
    assert after.engine.prefix_cache_hits - before.engine.prefix_cache_hits >= 2 * full_blocks, "choices 2 and 3 hit choice 1's"
    assert after.engine.prompt_tokens - before.engine.prompt_tokens < 2 * prompt_len, "the prompt was computed about once"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, seed=3, n=3,
                                         echo=True, logprobs=1, stream=True, extra_body={"ignore_eos": True})
    tokens = {0: [], 1: [], 2: []}  # the scores cross to the ingress once and lead every choice's stream
    for chunk in streamed:
        for c in chunk.choices:
            tokens[c.index] += c.logprobs.tokens if c.logprobs else []
    assert [tokens[c.index] for c in r.choices] == [c.logprobs.tokens for c in r.choices]


def test_n_choices_share_the_prompt_blocks_and_seeds_repeat(client, replica_handle):
    prompt = "A unique story opening for the n test: " + "the lighthouse keeper counted ships " * 12
    before = replica_handle.stats.remote().result()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=3,
                                  extra_body={"ignore_eos": True})
    after = replica_handle.stats.remote().result()
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3  # seed + i per choice
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens > 64
    full_blocks = (r.usage.prompt_tokens - 1) // 16 * 16
    assert after.engine.prefix_cache_hits - before.engine.prefix_cache_hits >= 2 * full_blocks  # choices 2 and 3 hit choice 1's
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    assert again.usage.prompt_tokens_details is None, "an unsalted caller is not told what others cached"
    salted = dict(extra_body={"ignore_eos": True, "cache_salt": "tenant-n"})
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=3, **salted)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=3, **salted)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    # its blocks, and of its last partial one what a freed choice's tail still shares with it
    assert full_blocks <= again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=3)
    assert len({c.text for c in greedy.choices}) == 1 and len(greedy.choices) == 3


def test_streamed_n_choices_each_start_and_finish(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0, n=2, stream=True, stream_options={"include_usage": True})
    texts, finished, usage = {0: "", 1: ""}, set(), None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] == texts[1] and texts[0]  # greedy: the same twice
    assert usage.completion_tokens == 12


def test_json_schema_output_parses_against_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, [{"role": "user", "content": "Invent a person."}], max_tokens=80, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"
    streamed = chat(client, [{"role": "user", "content": "Invent a person."}], max_tokens=80, response_format=fmt,
                    stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content


def test_json_object_mode_returns_an_object(client):
    r = chat(client, [{"role": "user", "content": 'Reply with a JSON object with a key "answer".'}], max_tokens=120,
             response_format={"type": "json_object"}, temperature=0.7, seed=1)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_named_tool_choice_always_calls_it_with_valid_arguments(client):
    r = chat(client, ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=60,
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])


def test_required_tool_choice_calls_one_of_the_tools(client):
    r = chat(client, ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False,
             max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_streamed_tool_calls_arrive_as_tool_call_deltas(client):
    stream = chat(client, ASK_WEATHER, tools=[WEATHER_TOOL], max_tokens=60, stream=True,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls, content, finish = {}, "", None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for call in c.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    assert content == "" and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(client):
    with_tools = chat(client, ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=4)
    without = chat(client, ASK_WEATHER, max_tokens=4)
    assert with_tools.usage.prompt_tokens == without.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None


def test_a_schema_request_leaves_its_batch_mates_output_alone(client):
    import concurrent.futures

    messages = [{"role": "user", "content": "Describe the sea in one sentence."}]
    alone = chat(client, messages, max_tokens=24).choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(chat, client, [{"role": "user", "content": "A person?"}], max_tokens=60,
                                   response_format=fmt) for _ in range(3)]
        plain = pool.submit(chat, client, messages, max_tokens=24)
        assert plain.result().choices[0].message.content == alone
        assert all(json.loads(f.result().choices[0].message.content) for f in constrained)


def streamed_chat(client, messages, **kwargs) -> tuple[str, list, str | None, object]:
    """(content, tool-call deltas, finish_reason, usage) of a streamed chat completion."""
    stream = chat(client, messages, stream=True, stream_options={"include_usage": True}, **kwargs)
    content, calls, finish, usage = "", [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    return content, calls, finish, usage


def test_the_same_features_streamed_give_what_they_give_whole(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]
    assert streamed_chat(client, parts, max_tokens=16)[0] == chat(client, parts, max_tokens=16).choices[0].message.content
    turns = [*ASK_WEATHER,
             {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"}]
    whole = chat(client, turns, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=16)
    content, _, _, usage = streamed_chat(client, turns, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=16)
    assert content == whole.choices[0].message.content and usage.prompt_tokens == whole.usage.prompt_tokens
    extras = {"min_tokens": 30, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2}
    _, _, _, usage = streamed_chat(client, [{"role": "user", "content": "Say OK."}], max_tokens=40, extra_body=extras)
    assert usage.completion_tokens >= 30
    content, _, finish, _ = streamed_chat(client, [{"role": "user", "content": 'A JSON object with key "a".'}],
                                          max_tokens=120, response_format={"type": "json_object"})
    assert content.startswith("{") and (finish != "stop" or isinstance(json.loads(content), dict))
    _, calls, finish, _ = streamed_chat(client, ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=60)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    prompt = [{"role": "user", "content": "A long shared question about cached prefixes: " + "why is the sea salty? " * 8}]
    chat(client, prompt, max_tokens=2, extra_body={"cache_salt": "tenant-stream"})
    assert streamed_chat(client, prompt, max_tokens=2, extra_body={"cache_salt": "tenant-stream"}
                         )[3].prompt_tokens_details.cached_tokens >= 32
