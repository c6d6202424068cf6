"""The Hermes tool-call format: parsing model output back into calls, and what a stream may send before a call."""
import json

from engine import tool_calls
from engine.tool_calls import ToolCall, parse, safe_content_length

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_call_alone_has_no_content():
    assert parse(CALL) == (None, [ToolCall("get_weather", '{"city": "Paris"}')])


def test_text_before_the_first_call_is_the_content_and_every_block_is_read():
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome")
    content, calls = parse(text)
    assert content == "Let me check." and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]


def test_smollm2s_list_form_is_read_too():
    text = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>'
    assert [c.name for c in parse(text)[1]] == ["a", "b"]


def test_malformed_calls_leave_the_text_as_content():
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "no call here"):
        assert parse(text) == (text, [])


def test_a_stream_holds_back_only_what_could_start_a_call():
    assert safe_content_length("Hello there") == len("Hello there")
    assert safe_content_length("Hello <tool") == len("Hello ")
    assert safe_content_length("Hello <b>") == len("Hello <b>")
    assert safe_content_length("Hi " + CALL) == 3


def test_written_calls_read_back_the_same():
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}]
    assert parse(tool_calls.as_text(calls))[1] == [ToolCall("f", '{"a": [1, 2]}')]


def test_a_long_run_of_whitespace_after_an_unclosed_tag_parses_in_linear_time():
    """The old regex (`<tool_call>\\s*(.*?)\\s*</tool_call>`) backtracked quadratically here, holding the GIL: 200,000
    spaces took hours. A child process gets a generous 20 s; str.find takes milliseconds."""
    import subprocess
    import sys

    code = ("from engine.tool_calls import parse; t = '<tool_call>' + ' ' * 200_000 + 'x'; "
            "assert parse(t) == (t, []); print('parsed')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert run.stdout.strip() == "parsed", run.stderr


def test_an_assistant_turn_with_arguments_nested_too_deep_keeps_them_as_sent():
    deep = "[" * 5000 + "]" * 5000
    text = tool_calls.as_text([{"function": {"name": "f", "arguments": deep}}])
    assert json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == {"name": "f", "arguments": deep}
