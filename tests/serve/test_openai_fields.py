"""The README's table of OpenAI fields is the truth: each field is sent once to each endpoint that has it, and gets
the outcome the table says (200, or a 400 that names the field)."""
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
}


def readme_table() -> dict[str, dict[str, str]]:
    text = README.read_text()
    table = text[text.index("<!-- openai-fields:start -->"):text.index("<!-- openai-fields:end -->")]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"^\| `(\w+)` \| (\S+) \| (\S+) \|", line)
        if match:
            rows[match[1]] = {"chat": match[2], "completions": match[3]}
    return rows


def test_the_table_lists_every_field_we_send():
    assert set(readme_table()) == set(EXAMPLES)
    assert {o for row in readme_table().values() for o in row.values()} == {"yes", "refused", "-"}


CASES = [(field, endpoint, outcome) for field, row in readme_table().items() for endpoint, outcome in row.items()
         if outcome != "-"]


@pytest.mark.parametrize("field,endpoint,outcome", CASES, ids=[f"{f}-{e}" for f, e, _ in CASES])
def test_each_field_gets_its_documented_outcome(base_url, auth, field, endpoint, outcome):
    example = EXAMPLES[field].get(endpoint, EXAMPLES[field]) if field == "logprobs" else EXAMPLES[field]
    body = {**BASE[endpoint], **example}
    with httpx.stream("POST", base_url + PATHS[endpoint], json=body, headers=auth, timeout=120) as r:
        content = r.read().decode()
    if outcome == "yes":
        assert r.status_code == 200 and "error" not in content, (field, content)
    else:
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, content)


def test_completions_without_max_tokens_stop_at_16_as_openais_do(base_url, auth):
    r = httpx.post(base_url + PATHS["completions"], json={"prompt": "Once upon a time", "ignore_eos": True},
                   headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length", body
