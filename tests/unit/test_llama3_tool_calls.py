"""Llama 3's JSON tool calls (vLLM's llama3_json parser): replies that are calls parse into them, anything else is
content; a stream holds back only what may still be a call; the forced-call grammar and the written-back call are
in the same format the parser reads."""
import json

import pytest

from engine import tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "now", "parameters": {}}', None, [("now", "{}")]),
    ('{"name": "now", "parameters": {}}; {"name": "get_weather", "arguments": {"city": "Oslo"}}', None,
     [("now", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ("  \n{\"name\": \"now\", \"parameters\": {}}\n", None, [("now", "{}")]),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
    ('{"name": "now", "parameters": "soon"}', '{"name": "now", "parameters": "soon"}', []),
    ('{"name": "now", "parameters": {}} and then some words', '{"name": "now", "parameters": {}} and then some words', []),
    ('{"name": "now", "parameters": {', '{"name": "now", "parameters": {', []),  # cut off
    ("[" * 5000, "[" * 5000, []),
])
def test_a_reply_is_calls_or_content(text, content, calls):
    got_content, got_calls = tool_calls.parse(text, "llama3_json")
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls


@pytest.mark.parametrize("text, safe", [("Sure", 4), ("", 0), ("  ", 0), ("{", 0), (' {"name"', 0), ("<|py", 0),
                                        ("<|python_tag|>{", 0), ("<b>bold</b>", 11)])
def test_a_stream_holds_back_what_may_still_be_a_call(text, safe):
    assert tool_calls.safe_content_length(text, "llama3_json") == safe


def test_a_written_back_call_parses_as_it_was_and_the_prompt_names_the_format():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    _, parsed = tool_calls.parse(tool_calls.as_text(calls, "llama3_json"), "llama3_json")
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [("get_weather", {"city": "Rome"}), ("now", {})]
    prompt = tool_calls.system_prompt(TOOLS, "llama3_json")
    assert '"parameters": dictionary of argument name' in prompt and '"get_weather"' in prompt
    assert "<tool_call>" not in prompt


def test_the_forced_call_grammar_is_one_call_or_several_joined_as_the_parser_reads_them():
    assert tool_calls.grammar(TOOLS, "now", fmt="llama3_json").startswith("start: call\ncall: %json ")
    assert tool_calls.grammar(TOOLS, fmt="llama3_json").startswith('start: call ("; " call)*\n')
    assert '"required": ["name", "parameters"]' in tool_calls.grammar(TOOLS, fmt="llama3_json")
