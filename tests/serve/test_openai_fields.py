"""The README's tables of OpenAI fields and of vLLM's extensions are the truth: each field is sent once to each
endpoint that has it, and gets the outcome the table says (200, or a 400 that names the field)."""
import re
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BASE = {"chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "completions": {"prompt": "hi", "max_tokens": 2}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# What each field is sent as: a value that exercises it (for refused fields, one that is refused)
EXAMPLES = {
    "model": {"model": "SmolLM2-135M-Instruct"}, "messages": {}, "prompt": {}, "max_tokens": {"max_tokens": 3},
    "max_completion_tokens": {"max_completion_tokens": 3}, "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.9},
    "n": {"n": 2}, "stop": {"stop": ["\n"]}, "seed": {"seed": 5}, "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5}, "logit_bias": {"logit_bias": {"42": -5}},
    "logprobs": {"chat": {"logprobs": True}, "completions": {"logprobs": 2}},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2}, "echo": {"echo": True},
    "response_format": {"response_format": {"type": "json_object"}, "max_tokens": 8},
    "tools": {"tools": [TOOL]}, "tool_choice": {"tools": [TOOL], "tool_choice": "required", "max_tokens": 12},
    "parallel_tool_calls": {"tools": [TOOL], "parallel_tool_calls": False}, "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}}, "user": {"user": "u1"},
    "safety_identifier": {"safety_identifier": "s1"}, "prompt_cache_key": {"prompt_cache_key": "k"},
    "metadata": {"metadata": {"team": "a"}}, "service_tier": {"service_tier": "auto"}, "best_of": {"best_of": 1},
    "store": {"store": True}, "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "modalities": {"modalities": ["text", "audio"]}, "prediction": {"prediction": {"type": "content", "content": "x"}},
    "functions": {"functions": [{"name": "f"}]}, "function_call": {"function_call": "auto"},
    "web_search_options": {"web_search_options": {}}, "reasoning_effort": {"reasoning_effort": "low"},
    "verbosity": {"verbosity": "low"}, "suffix": {"suffix": "the end"},
    # vLLM's
    "top_k": {"top_k": 5}, "min_p": {"min_p": 0.1}, "repetition_penalty": {"repetition_penalty": 1.2},
    "stop_token_ids": {"stop_token_ids": [2]}, "min_tokens": {"min_tokens": 1}, "ignore_eos": {"ignore_eos": True},
    "include_stop_str_in_output": {"include_stop_str_in_output": True, "stop": ["e"]},
    "skip_special_tokens": {"skip_special_tokens": False}, "cache_salt": {"cache_salt": "tenant-a"},
    "request_id": {"request_id": "mine-1"},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "guided_json": {"guided_json": {"type": "object"}, "max_tokens": 8}, "guided_regex": {"guided_regex": "[0-9]{2}"},
    "guided_choice": {"guided_choice": ["yes", "no"]}, "guided_grammar": {"guided_grammar": 'root ::= "yes" | "no"'},
    "guided_decoding_backend": {"guided_decoding_backend": "xgrammar"},
    "guided_whitespace_pattern": {"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]?",
                                  "max_tokens": 8}, "use_beam_search": {"use_beam_search": True, "n": 2},
    "length_penalty": {"use_beam_search": True, "length_penalty": 0.5}, "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 4}, "prompt_logprobs": {"prompt_logprobs": 1},
    "allowed_token_ids": {"allowed_token_ids": [1, 2]}, "bad_words": {"bad_words": ["sea"]},
    "priority": {"priority": 1}, "logits_processors": {"logits_processors": ["my.Processor"]},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True}, "return_token_ids": {"return_token_ids": True},
    "kv_transfer_params": {"kv_transfer_params": {}}, "vllm_xargs": {"vllm_xargs": {"k": 1}},
    "max_repetition_pattern_size": {"max_repetition_pattern_size": 4, "repetition_min_count": 3},
    "repetition_detection": {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}},
    "mm_processor_kwargs": {"mm_processor_kwargs": {}}, "documents": {"documents": [{"title": "t", "text": "x"}]},
    "chat_template": {"chat_template": "{{ messages }}"}, "add_special_tokens": {"add_special_tokens": True},
    "prompt_embeds": {"prompt_embeds": "AAAA"}, "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
                               "add_generation_prompt": False, "continue_final_message": True},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "include_reasoning": {"include_reasoning": False},
    "truncation_side": {"truncate_prompt_tokens": 3, "truncation_side": "right"}, "stream_interval": {
        "stream": True, "stream_interval": 2}, "session_id": {"session_id": "chat-42"},
    "return_prompt_text": {"return_prompt_text": True}, "thinking_token_budget": {"thinking_token_budget": -1},
    "watermarking": {"watermarking": True}, "logprob_token_ids": {
        "chat": {"logprobs": True, "logprob_token_ids": [5, 9]}, "completions": {"logprobs": 0, "logprob_token_ids": [5]}},
    "return_token_offsets": {"return_token_offsets": True}, "media_io_kwargs": {"media_io_kwargs": {"image": {}}},
    "mm_payload": {"mm_payload": "none"}, "return_mm_kwargs": {"return_mm_kwargs": False},
    "ec_transfer_params": {"ec_transfer_params": {}}, "routed_experts_prompt_start": {"routed_experts_prompt_start": 2},
}

PER_ENDPOINT = ("logprobs", "logprob_token_ids")  # examples that differ by endpoint: {"chat": ..., "completions": ...}


def readme_table() -> dict[str, dict[str, str]]:
    text, rows = README.read_text(), {}
    for name in ("openai-fields", "vllm-fields"):
        table = text[text.index(f"<!-- {name}:start -->"):text.index(f"<!-- {name}:end -->")]
        for line in table.splitlines():
            match = re.match(r"^\| `(\w+)` \| (\S+) \| (\S+) \|", line)
            if match:
                assert match[1] not in rows, f"{match[1]} is in two tables"
                rows[match[1]] = {"chat": match[2], "completions": match[3]}
    return rows


def test_the_table_lists_every_field_we_send():
    assert set(readme_table()) == set(EXAMPLES)
    assert {o for row in readme_table().values() for o in row.values()} == {"yes", "refused", "-"}


CASES = [(field, endpoint, outcome) for field, row in readme_table().items() for endpoint, outcome in row.items()
         if outcome != "-"]


@pytest.mark.parametrize("field,endpoint,outcome", CASES, ids=[f"{f}-{e}" for f, e, _ in CASES])
def test_each_field_gets_its_documented_outcome(base_url, auth, field, endpoint, outcome):
    example = EXAMPLES[field].get(endpoint, EXAMPLES[field]) if field in PER_ENDPOINT else EXAMPLES[field]
    body = {**BASE[endpoint], **example}
    with httpx.stream("POST", base_url + PATHS[endpoint], json=body, headers=auth, timeout=120) as r:
        content = r.read().decode()
    if outcome == "yes":
        # an error object (whole, or in-band in a stream), not the word: a sampled "-terrorism" once failed this
        assert r.status_code == 200 and '"error":' not in content, (field, content)
    else:
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, content)


def test_completions_without_max_tokens_stop_at_16_as_openais_do(base_url, auth):
    r = httpx.post(base_url + PATHS["completions"], json={"prompt": "Once upon a time", "ignore_eos": True},
                   headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length", body
