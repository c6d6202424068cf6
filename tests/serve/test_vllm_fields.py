"""vLLM's request extensions through the `openai` client's `extra_body`, against the real app under Ray Serve (fp32
engine, embedded model): structured outputs in vLLM's current and pre-0.12 spellings, stop strings kept in the
text, special tokens shown, the caller's request id. Which fields are refused is the README table's test."""
import json
import re

import httpx
import openai
import pytest

from engine.repetition import RepetitionDetection
from tests.fixtures.repetition import first_stop

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Write an email address, then describe a person."}]
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.com"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=serve_app["base_url"] + "/v1", api_key=serve_app["api_key"], max_retries=0, timeout=120)


def chat(client, **extra):
    return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0.0, extra_body=extra)


def test_a_choice_bounds_the_reply_in_both_spellings_and_on_both_endpoints(client):
    for extra in ({"structured_outputs": {"choice": ["kind", "cruel"]}}, {"guided_choice": ["kind", "cruel"]}):
        reply = chat(client, **extra).choices[0]
        assert reply.message.content in ("kind", "cruel") and reply.finish_reason == "stop", extra
        completion = client.completions.create(model=MODEL, prompt="The villain was", max_tokens=10, temperature=0.0,
                                               extra_body=extra).choices[0]
        assert completion.text in ("kind", "cruel"), extra


def test_a_streamed_regex_reply_matches_it_whole(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0.0, stream=True,
                                            extra_body={"structured_outputs": {"regex": EMAIL}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert re.fullmatch(EMAIL, text), text


def test_a_gbnf_grammar_bounds_a_completion(client):
    grammar = 'root ::= "SELECT " column " FROM people"\ncolumn ::= "name" | "age"'
    for extra in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
        text = client.completions.create(model=MODEL, prompt="-- the names of everyone\n", max_tokens=20,
                                         temperature=0.0, extra_body=extra).choices[0].text
        assert re.fullmatch(r"SELECT (name|age) FROM people", text), (extra, text)


def test_a_json_schema_as_text_with_additional_properties_disabled_gives_exactly_its_keys(client):
    extra = {"structured_outputs": {"json": json.dumps(PERSON), "disable_additional_properties": True}}
    reply = chat(client, **extra).choices[0]
    assert set(json.loads(reply.message.content)) == {"name", "age"}, reply.message.content
    reply = chat(client, guided_json=PERSON).choices[0]
    assert {"name", "age"} <= set(json.loads(reply.message.content))


@pytest.mark.parametrize("extra", [{"structured_outputs": {"json": PERSON, "whitespace_pattern": "\n"}},
                                   {"guided_json": PERSON, "guided_whitespace_pattern": "\n"},
                                   {"response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "p", "schema": PERSON}},
                                    "guided_whitespace_pattern": "\n"}],
                         ids=["structured-outputs", "guided", "response-format"])
def test_a_whitespace_pattern_lays_out_the_json_reply(client, extra):
    """vLLM's whitespace_pattern: newlines around the JSON's punctuation, none of the default ', ' and ': '."""
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                           max_tokens=80, temperature=0.0, extra_body=extra).choices[0]
    text = reply.message.content
    assert reply.finish_reason == "stop" and isinstance(json.loads(text), dict), text
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert "\n" in outside_strings and " " not in outside_strings, text


@pytest.mark.parametrize("extra,field", [
    ({"structured_outputs": {"choices": ["a", "b"]}}, "structured_outputs.choices"),  # vLLM's docs' own misspelling
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": 'root ::= "a" | ('}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_choice": ["a"], "tools": [{"type": "function", "function": {"name": "f"}}]}, "guided_choice"),
    ({"request_id": "two words"}, "request_id"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": "("}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " ", "disable_any_whitespace": True}},
     "structured_outputs.whitespace_pattern"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " "}, "guided_whitespace_pattern": "\n"},
     "guided_whitespace_pattern"),
], ids=["misspelled-key", "bad-regex", "bad-json", "bad-gbnf", "two-kinds", "structural-tag", "two-fields",
        "with-tools", "bad-request-id", "bad-whitespace", "whitespace-in-a-regex", "whitespace-beside-disable",
        "guided-whitespace-alone", "guided-whitespace-in-a-regex", "two-whitespace-patterns"])
def test_a_constraint_that_cannot_be_is_a_400_naming_its_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, **extra)
    error = refused.value.body
    assert error["param"] == field and field in error["message"], error


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(client):
    whole = chat(client).choices[0].message.content
    stop = whole.split()[3]  # a word well inside the greedy reply
    cut = chat(client, stop=[stop]).choices[0]
    kept = chat(client, stop=[stop], include_stop_str_in_output=True).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.message.content == cut.message.content + stop and whole.startswith(kept.message.content)


def test_special_tokens_show_when_not_skipped(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=40, temperature=0.0)
    shown = client.chat.completions.create(**args, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    skipped = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    assert "<|im_end|>" in shown.choices[0].message.content
    assert "<|im_end|>" not in skipped.choices[0].message.content
    assert shown.usage.completion_tokens == skipped.usage.completion_tokens == 40


def test_the_callers_request_id_is_the_responses_id(client):
    assert chat(client, request_id="trace-7.a:b").id == "trace-7.a:b"
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                                       extra_body={"request_id": "trace-8"})
    assert {chunk.id for chunk in stream} == {"trace-8"}


def test_continue_final_message_continues_it_as_a_completion_of_the_same_tokens_would(client, serve_app):
    """The chat reply of an open last message equals the completion of the ids /tokenize gives for the same
    messages and options: the template left the message open, and the reply picks up inside it."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour I pick is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = httpx.post(serve_app["base_url"] + "/tokenize", json={"messages": messages, **options},
                        headers={"Authorization": f"Bearer {serve_app['api_key']}"}, timeout=60).json()
    assert tokens["count"] > 0
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.0,
                                           extra_body=options)
    completion = client.completions.create(model=MODEL, prompt=tokens["tokens"], max_tokens=12, temperature=0.0)
    assert reply.choices[0].message.content == completion.choices[0].text
    assert reply.usage.prompt_tokens == tokens["count"] == completion.usage.prompt_tokens
    opened = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1)
    closed = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1,
                                            extra_body={"add_generation_prompt": False})
    assert closed.usage.prompt_tokens < opened.usage.prompt_tokens  # no assistant turn opened


@pytest.mark.parametrize("extra,field", [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default add_generation_prompt
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
], ids=["both-flags", "messages", "special-token", "not-identifier"])
def test_chat_options_that_cannot_be_are_400s_naming_their_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, **extra)
    assert refused.value.body["param"] == field, refused.value.body


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_chat_or_completion_prompt(client):
    long = "Tell me about the sea. " * 20
    completion = client.completions.create(model=MODEL, prompt=long, max_tokens=2,
                                           extra_body={"truncate_prompt_tokens": 3})
    assert completion.usage.prompt_tokens == 3  # the engine's test checks which three
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=2,
                                           extra_body={"truncate_prompt_tokens": 7})
    assert reply.usage.prompt_tokens == 7


def test_truncation_side_right_keeps_a_prompts_first_tokens(serve_app):
    long = "Tell me about the sea. " * 20
    body = {"prompt": long, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    (cut,) = post(serve_app, "/v1/completions", {**body, "truncate_prompt_tokens": 5,
                                                 "truncation_side": "right"}).json()["choices"]
    ids = post(serve_app, "/tokenize", {"prompt": long}).json()["tokens"]
    (head,) = post(serve_app, "/v1/completions", {**body, "prompt": ids[:5]}).json()["choices"]
    assert cut["prompt_token_ids"] == ids[:5] and cut["token_ids"] == head["token_ids"], (cut, head)


def test_return_prompt_text_gives_the_prompt_the_template_wrote_whole_and_on_a_streams_first_chunk(serve_app):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3, "return_prompt_text": True}
    whole = post(serve_app, "/v1/chat/completions", body).json()
    assert whole["prompt_text"].endswith("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")
    assert "prompt_text" not in post(serve_app, "/v1/chat/completions", {**body, "return_prompt_text": False}).json()
    with httpx.stream("POST", serve_app["base_url"] + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120, headers={"Authorization": f"Bearer {serve_app['api_key']}"}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c.get("prompt_text") for c in chunks] == [whole["prompt_text"]] + [None] * (len(chunks) - 1)


def post(serve_app, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(serve_app["base_url"] + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {serve_app['api_key']}"}, **kwargs)


def test_return_token_ids_gives_the_prompts_and_each_choices_ids_whole_and_streamed(serve_app):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = post(serve_app, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0.0,
                                                     "return_token_ids": True}).json()
    prompt = post(serve_app, "/tokenize", {"messages": messages}).json()["tokens"]
    (choice,) = whole["choices"]
    assert whole["prompt_token_ids"] == prompt and len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    assert post(serve_app, "/detokenize", {"tokens": choice["token_ids"]}).json()["prompt"] == choice["message"]["content"]
    # a streamed completion, two greedy choices: each choice's chunks carry its new ids, its first its prompt's
    body = {"prompt": "Colours: red,", "max_tokens": 10, "temperature": 0.0, "n": 2, "return_token_ids": True,
            "stream": True, "ignore_eos": True}
    ids, prompts = {0: [], 1: []}, {}
    with httpx.stream("POST", serve_app["base_url"] + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {serve_app['api_key']}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids[c["index"]] += c["token_ids"]
                    if "prompt_token_ids" in c:
                        prompts.setdefault(c["index"], c["prompt_token_ids"])
    expected = post(serve_app, "/tokenize", {"prompt": "Colours: red,"}).json()["tokens"]
    assert prompts == {0: expected, 1: expected} and len(ids[0]) == 10 and ids[0] == ids[1]


def test_token_limits_and_token_id_names_reach_the_engine_through_http(client, serve_app):
    digits = post(serve_app, "/tokenize", {"prompt": "0 1 2 3 4 5 6 7 8 9"}).json()["tokens"]
    reply = chat(client, allowed_token_ids=digits, max_tokens=6, logprobs=True, top_logprobs=2,
                 return_tokens_as_token_ids=True, ignore_eos=True).choices[0]
    names = [entry.token for entry in reply.logprobs.content]
    assert len(names) == 6 and all(re.fullmatch(r"token_id:\d+", name) for name in names), names
    assert {int(name.split(":")[1]) for name in names} <= set(digits)
    assert all(re.fullmatch(r"token_id:\d+", top.token) for entry in reply.logprobs.content for top in entry.top_logprobs)
    free = chat(client, max_tokens=12).choices[0].message.content
    word = free.split()[0].strip(".,!?")
    assert word.lower() not in chat(client, max_tokens=12, bad_words=[word]).choices[0].message.content.lower()[:len(word) + 2]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, allowed_token_ids=[10 ** 7])
    assert refused.value.body["param"] == "allowed_token_ids", refused.value.body


def test_logprob_token_ids_score_the_listed_tokens_at_every_position_whole_and_streamed(client, serve_app):
    """vLLM's label scoring: each position's top_logprobs are the chosen token's and the listed ids', in that order
    (an id listed twice or chosen shows once), the same raw logprobs the top 20 give."""
    named = dict(max_tokens=5, logprobs=True, return_tokens_as_token_ids=True)
    top = chat(client, top_logprobs=20, **named).choices[0].logprobs.content
    scores = [{int(t.token.split(":")[1]): t.logprob for t in entry.top_logprobs} for entry in top]
    chosen = [int(entry.token.split(":")[1]) for entry in top]
    listed = [sorted(scores[0], key=scores[0].get)[0], chosen[1], sorted(scores[0], key=scores[0].get)[0]]
    labelled = chat(client, logprob_token_ids=listed, **named).choices[0].logprobs.content
    assert [int(e.token.split(":")[1]) for e in labelled] == chosen
    for position, entry in enumerate(labelled):
        ids = [int(t.token.split(":")[1]) for t in entry.top_logprobs]
        assert ids == list(dict.fromkeys([chosen[position], *listed])), (position, ids)
        for token, t in zip(ids, entry.top_logprobs):
            if token in scores[position]:
                assert t.logprob == pytest.approx(scores[position][token], abs=1e-4), (position, token)
    stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0.0,
                                       logprobs=3, stream=True, extra_body={"logprob_token_ids": listed[:2]})
    tops = [top for chunk in stream for c in chunk.choices if c.logprobs for top in c.logprobs.top_logprobs]
    assert len(tops) == 4 and all(1 < len(top) <= 3 for top in tops), tops


@pytest.mark.parametrize("extra,field", [
    ({"logprob_token_ids": [5]}, "logprob_token_ids"),  # without logprobs
    ({"logprobs": True, "logprob_token_ids": [10 ** 7]}, "logprob_token_ids"),
    ({"logprobs": True, "logprob_token_ids": list(range(129))}, "logprob_token_ids"),
    ({"logprobs": True, "logprob_token_ids": [5], "use_beam_search": True, "n": 2}, "logprob_token_ids"),
])
def test_logprob_token_ids_that_cannot_be_are_400s_naming_the_field(serve_app, extra, field):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **extra}
    refused = post(serve_app, "/v1/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


def test_priority_reaches_the_engine_whose_fcfs_policy_serves_only_0(client):
    assert chat(client, priority=0, max_tokens=2).choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, priority=-3, max_tokens=2)
    assert refused.value.body["param"] == "priority" and "scheduling_policy fcfs" in refused.value.body["message"]


def test_prompt_logprobs_give_each_prompt_tokens_logprob_and_rank_as_hf_computes_them(serve_app):
    import torch

    from tests.engine.helpers import load_hf_model

    body = {"prompt": "The capital of France is Paris, and the capital of Spain is", "max_tokens": 2,
            "temperature": 0.0, "prompt_logprobs": 2, "n": 2}
    completion = post(serve_app, "/v1/completions", body).json()
    ids = post(serve_app, "/tokenize", {"prompt": body["prompt"]}).json()["tokens"]
    first, second = completion["choices"]
    assert first["prompt_logprobs"] == second["prompt_logprobs"] and first["prompt_logprobs"][0] is None
    with torch.no_grad():
        reference = torch.log_softmax(load_hf_model(MODEL)(torch.tensor([ids])).logits[0].float(), -1)
    for position, entry in enumerate(first["prompt_logprobs"][1:], start=1):
        token, row = ids[position], reference[position - 1]
        mine = entry[str(token)]
        assert abs(mine["logprob"] - float(row[token])) < 1e-4, position
        low, high = (1 + int((row > row[token] + margin).sum()) for margin in (1e-3, -1e-3))
        assert low <= mine["rank"] <= high, (position, mine, low, high)
        assert len(entry) in (2, 3) and any(e["rank"] == 1 for e in entry.values())
    chat_body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    reply = post(serve_app, "/v1/chat/completions", chat_body).json()
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"] and reply["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in reply["prompt_logprobs"][1:])  # the prompt's own token, no alternatives
    for extra in ({"stream": True}, {"echo": True, "logprobs": 1}, {"prompt": "hi " * 4500}):
        refused = post(serve_app, "/v1/completions", {**body, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs", refused.text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True}, stream_options={
                                                "include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert all(chunk.usage is not None for chunk in chunks) and counts == sorted(counts) and counts[-1] == 12
    assert len({chunk.usage.prompt_tokens for chunk in chunks}) == 1 and len(chunks) > 3


def test_use_beam_search_gives_the_offline_engines_beams_as_choices_whole_and_streamed(client, llm32):
    from engine import BeamSearchParams

    prompt = "The best thing about the sea is"
    expected = llm32.beam_search(prompt, BeamSearchParams(3, max_tokens=8), use_tqdm=False)[0].sequences
    reply = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=8,
                                      extra_body={"use_beam_search": True, "return_token_ids": True})
    assert [c.text for c in reply.choices] == [b.text for b in expected]
    assert [c.finish_reason for c in reply.choices] == [b.finish_reason for b in expected]
    assert reply.usage.completion_tokens == sum(len(b.tokens) for b in expected) - 3 * len(reply.choices[0].prompt_token_ids)
    streamed = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=8, stream=True,
                                         extra_body={"use_beam_search": True})
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [b.text for b in expected]
    chat = client.chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=6, temperature=0.0,
                                          extra_body={"use_beam_search": True, "length_penalty": 0.0})
    assert len({c.message.content for c in chat.choices}) == 2


@pytest.mark.parametrize("extra,field", [({"temperature": 0.7}, "temperature"), ({"stop": ["\n"]}, "stop"),
                                         ({"logprobs": True}, "logprobs"), ({"top_k": 5}, "top_k"),
                                         ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
                                         ({"n": 11}, "n"),
                                         ({"repetition_detection": {"max_pattern_size": 4, "min_count": 2}},
                                          "repetition_detection")])
def test_what_a_beam_search_cannot_follow_is_a_400_naming_the_field(serve_app, extra, field):
    body = {"messages": ASK, "max_tokens": 4, "n": 2, "use_beam_search": True, **extra}
    r = httpx.post(serve_app["base_url"] + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {serve_app['api_key']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


SPELLINGS = [{"repetition_detection": {"max_pattern_size": 8, "min_count": 3}},
             {"max_repetition_pattern_size": 8, "repetition_min_count": 3}]  # vLLM's current, and before 0.32


@pytest.mark.parametrize("rule", SPELLINGS, ids=["object", "flat"])
def test_a_completion_that_repeats_ends_where_the_pattern_completes_whole_and_streamed(serve_app, rule):
    """vLLM's repetition detection: the free greedy output, cut at its first token that ends a pattern of up to 8
    tokens seen 3 times in a row, finish_reason "repetition"; the stream's chunks add up to the same."""
    body = {"prompt": "1, 2, 1, 2, 1,", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    free = post(serve_app, "/v1/completions", body).json()["choices"][0]
    cut = first_stop(free["token_ids"], RepetitionDetection(8, 1, 3), 0)
    assert cut is not None and cut < 40, free
    (choice,) = post(serve_app, "/v1/completions", {**body, **rule}).json()["choices"]
    assert choice["token_ids"] == free["token_ids"][:cut] and choice["finish_reason"] == "repetition", choice
    assert choice["stop_reason"] == "repetition_detected" and free["stop_reason"] is None
    assert choice["text"] == post(serve_app, "/detokenize", {"tokens": choice["token_ids"]}).json()["prompt"]
    text, reasons = "", []
    with httpx.stream("POST", serve_app["base_url"] + "/v1/completions", json={**body, **rule, "stream": True},
                      timeout=120, headers={"Authorization": f"Bearer {serve_app['api_key']}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text, reasons = text + c["text"], reasons + [(c["finish_reason"], c.get("stop_reason"))]
    assert text == choice["text"] and [r for r in reasons if r[0]] == [("repetition", "repetition_detected")]


def test_each_choice_names_what_stopped_it_as_vllm_does_whole_and_streamed(client):
    """vLLM's stop_reason: the stop string or stop token id that ended a choice; None for an EOS or the length."""
    prompt, base = "The capital of France is", dict(model=MODEL, max_tokens=12, temperature=0.0)
    free = client.completions.create(prompt=prompt, **base, extra_body={"ignore_eos": True,
                                                                         "return_token_ids": True}).choices[0]
    assert free.finish_reason == "length" and free.stop_reason is None
    word = free.text.split()[1]
    by_string = client.completions.create(prompt=prompt, **base, stop=["zzz", word]).choices[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", word)
    stream = client.completions.create(prompt=prompt, **base, stop=[word], stream=True)
    ends = [(c.finish_reason, getattr(c, "stop_reason", None)) for chunk in stream for c in chunk.choices]
    assert [end for end in ends if end[0]] == [("stop", word)]
    ask, keep_on = [{"role": "user", "content": prompt}], {"ignore_eos": True}
    token = client.chat.completions.create(messages=ask, **base, extra_body={**keep_on, "return_token_ids": True}
                                           ).choices[0].token_ids[2]
    by_id = client.chat.completions.create(messages=ask, **base, extra_body={**keep_on, "stop_token_ids": [token]})
    assert (by_id.choices[0].finish_reason, by_id.choices[0].stop_reason) == ("stop", token)
    streamed = client.chat.completions.create(messages=ask, **base, stream=True,
                                              extra_body={**keep_on, "stop_token_ids": [token]})
    assert [(c.finish_reason, c.stop_reason) for chunk in streamed for c in chunk.choices if c.finish_reason] == [
        ("stop", token)]


def test_a_chat_reply_that_repeats_ends_at_its_first_repeat(client):
    ask = [{"role": "user", "content": "List the letters a, b, a, b, a, b, and continue the pattern."}]
    base = dict(model=MODEL, messages=ask, max_tokens=60, temperature=0.0)
    free = client.chat.completions.create(**base, extra_body={"ignore_eos": True, "return_token_ids": True})
    cut = first_stop(free.choices[0].token_ids, RepetitionDetection(4, 1, 4), 0)
    assert cut is not None and cut < 60, free.choices[0].message.content
    reply = client.chat.completions.create(**base, extra_body={
        "ignore_eos": True, "return_token_ids": True, "repetition_detection": {"max_pattern_size": 4, "min_count": 4}})
    (choice,) = reply.choices
    assert (choice.finish_reason, choice.stop_reason) == ("repetition", "repetition_detected")
    assert choice.token_ids == free.choices[0].token_ids[:cut] and reply.usage.completion_tokens == cut


@pytest.mark.parametrize("extra,field", [
    ({"repetition_min_count": 3}, "repetition_min_count"),
    ({"min_repetition_pattern_size": 2}, "min_repetition_pattern_size"),
    ({"max_repetition_pattern_size": 4}, "repetition_min_count"),
    ({"max_repetition_pattern_size": 4, "repetition_min_count": 1}, "repetition_min_count"),
    ({"max_repetition_pattern_size": 4, "min_repetition_pattern_size": 5, "repetition_min_count": 2},
     "min_repetition_pattern_size"),
    ({"max_repetition_pattern_size": 5000, "repetition_min_count": 2}, "max_repetition_pattern_size"),
    ({"max_repetition_pattern_size": -1}, "max_repetition_pattern_size"),
    ({"repetition_detection": {"min_count": 3}}, "repetition_detection.min_count"),
    ({"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection.min_count"),
    ({"repetition_detection": {"max_pattern_size": 4, "min_pattern_size": 9, "min_count": 2}},
     "repetition_detection.min_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": 5000, "min_count": 2}}, "repetition_detection.max_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 2, "window": 9}}, "repetition_detection.window"),
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 2}, "repetition_min_count": 2},
     "repetition_min_count"),
], ids=["count-alone", "min-alone", "no-count", "count-1", "min-over-max", "max-too-large", "negative",
        "object-count-alone", "object-no-count", "object-min-over-max", "object-max-too-large", "object-unknown-key",
        "both-spellings"])
def test_a_repetition_rule_that_cannot_be_is_a_400_naming_its_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, **extra)
    error = refused.value.body
    assert error["param"] == field and field in error["message"], error
