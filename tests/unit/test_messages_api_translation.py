"""Anthropic's Messages API translation, as pure logic: a request becomes the chat request it means, a refusal names
the Messages field, and chat chunks become the event stream Anthropic's client parses (checked with the client's own
models and its own accumulator against the whole message)."""
import asyncio
import json
import re
from pathlib import Path

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter, ValidationError

from serve_app.errors import OpenAIError, envelope
from serve_app.messages_api import CountTokensRequest, MessagesRequest
from serve_app.messages_api_output import event_stream, message_object

WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
EVENT = TypeAdapter(RawMessageStreamEvent)


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 9,
                                          "messages": [{"role": "user", "content": "hi"}], **fields})


def test_turns_become_chat_messages_with_tool_results_first_and_earlier_thinking_left_out():
    asked = request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use metric units."}],
                    tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                     {"type": "text", "text": "Oslo?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 C"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "timed out"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
        {"role": "system", "content": "Answer in one word."}], stop_sequences=["\n\n"], top_k=5)
    chat = asked.chat_request(parses_reasoning=False)
    turns = [(m.role, m.content, m.tool_call_id) for m in chat.messages]
    assert turns == [("system", "Be brief.\nUse metric units.", None), ("user", "Weather in \nOslo?", None),
                     ("assistant", None, None), ("tool", "4 C", "toolu_1"), ("tool", "Error: timed out", "toolu_2"),
                     ("user", "And tomorrow?", None), ("system", "Answer in one word.", None)]
    call = chat.messages[2].tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("toolu_1", "get_weather",
                                                                                 {"city": "Oslo"})
    assert chat.effective_tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert (chat.max_completion_tokens, chat.stop, chat.top_k, chat.stream) == (9, ["\n\n"], 5, False)


def test_claude_codes_own_roles_are_the_users_and_its_billing_header_is_left_out():
    asked = request(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9f3a;"},
                            {"type": "text", "text": "You are Claude Code."}],
                    messages=[{"role": "ctx", "content": "cwd: /repo"}, {"role": "msg", "content": "fix the bug"}])
    turns = [(m.role, m.content) for m in asked.chat_request(False).messages]
    assert turns == [("system", "You are Claude Code."), ("user", "cwd: /repo\nfix the bug")]  # one user turn


def test_consecutive_turns_of_one_role_are_one_turn_as_anthropics_api_combines_them():
    asked = request(messages=[
        {"role": "user", "content": "Plan a trip."}, {"role": "user", "content": [{"type": "text", "text": "To Oslo."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 C"}]},
        {"role": "user", "content": "Pack for it."},
        {"role": "assistant", "content": "Pack"}, {"role": "assistant", "content": [{"type": "text", "text": "a coat"}]}],
        tools=[WEATHER])
    chat = asked.chat_request(parses_reasoning=False)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("user", "Plan a trip.\nTo Oslo."), ("assistant", None), ("tool", "4 C"), ("user", "Pack for it."),
        ("assistant", "Pack\na coat")]
    assert chat.continue_final_message and not chat.add_generation_prompt  # the combined last turn is the prefill
    assert asked._origins == [0, 2, 3, 3, 5]  # each chat message's first Messages turn, for renamed refusals
    called_last = request(messages=[{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "assistant", "content": "Checking."}], tools=[WEATHER]).chat_request(parses_reasoning=False)
    assert not called_last.continue_final_message  # one turn with a tool call: whole, not a prefill


def test_thinking_options_become_a_budget_only_where_the_app_parses_thinking():
    enabled = request(thinking={"type": "enabled", "budget_tokens": 64})
    assert enabled.chat_request(True).thinking_token_budget == 64
    assert request(thinking={"type": "disabled"}).chat_request(True).thinking_token_budget == 0
    assert request(thinking={"type": "disabled"}).chat_request(False).thinking_token_budget is None
    assert request(thinking={"type": "adaptive", "display": "omitted"}).chat_request(True).include_reasoning is False
    assert request(max_tokens=0).chat_request(False).max_completion_tokens == 1  # a token is computed, none shown


def test_effort_is_the_reasoning_effort_of_a_template_that_reads_it_and_high_asks_nothing_of_one_that_does_not():
    assert request(output_config={"effort": "low"}).chat_request(False).reasoning_effort == "low"
    high = request(output_config={"effort": "high"}, chat_template_kwargs={"enable_thinking": True})
    chat = high.chat_request(False)
    assert chat.reasoning_effort is None  # the check that refuses a template without it
    assert chat.chat_template_kwargs == {"reasoning_effort": "high", "enable_thinking": True}  # read where known
    assert request().chat_request(False).chat_template_kwargs is None
    refused = request(output_config={"effort": "medium"}).renamed(OpenAIError(
        400, "reasoning_effort: the chat template does not read it", "reasoning_effort"))
    assert refused.param == "output_config.effort" and refused.message.startswith("output_config.effort: ")


def test_a_last_assistant_turn_is_a_prefill_the_reply_continues():
    prefilled = request(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}])
    chat = prefilled.chat_request(False)
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert request().chat_request(False).add_generation_prompt
    called = request(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}])
    assert called.chat_request(False).add_generation_prompt  # a turn of tool calls is whole: a new turn follows


@pytest.mark.parametrize("fields,field", [
    ({"container": "c"}, "container"), ({"context_management": {"edits": []}}, "context_management"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0"), ({"workspace_id": "w"}, "workspace_id"),
    ({"inference_geo": "us"}, "inference_geo"), ({"diagnostics": {"previous_message_id": "msg_1"}}, "diagnostics"),
])
def test_what_is_not_served_is_refused_by_name(fields, field):
    with pytest.raises(ValidationError) as refused:
        request(**fields)
    assert refused.value.errors()[0]["ctx"]["path"] == field


@pytest.mark.parametrize("fields,field", [
    ({"thinking": {"type": "enabled"}}, "thinking"), ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, "messages.0"),
    ({"output_format": {"type": "json_schema", "schema": {}}, "output_config": {"format": {"type": "json_schema",
                                                                                          "schema": {}}}}, ""),
    ({"temperature": 1.5}, "temperature"), ({"stream": True, "invented": 1}, "invented")])
def test_what_cannot_be_is_refused_at_its_field(fields, field):
    with pytest.raises(ValidationError) as refused:
        request(**fields)
    assert ".".join(map(str, refused.value.errors()[0]["loc"])).startswith(field), refused.value.errors()


def test_a_check_of_the_chat_request_names_the_messages_field():
    with pytest.raises(OpenAIError) as refused:
        request(tools=[{**WEATHER, "name": "bad name"}]).chat_request(False)
    assert refused.value.param == "tools.0.name" and refused.value.message.startswith("tools.0.name: ")
    asked = request(system="s", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    asked.chat_request(False)
    assert asked.renamed(OpenAIError(400, "messages.2.content: too long", "messages.2.content")).param == "messages.1"
    assert asked.renamed(OpenAIError(400, "messages.0: bad", "messages.0")).param == "system"
    renamed = asked.renamed(OpenAIError(400, "max_completion_tokens is 9; at most 4", "max_completion_tokens"))
    assert (renamed.param, renamed.message) == ("max_tokens", "max_tokens is 9; at most 4")
    assert asked.renamed(OpenAIError(400, "thinking_token_budget needs", "thinking_token_budget")).param == \
        "thinking.budget_tokens"
    counted = CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [WEATHER]})
    assert counted.chat_request(False).tools[0].function.name == "get_weather"


CALL = {"index": 0, "id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18, "prompt_tokens_details": {"cached_tokens": 4},
         "completion_tokens_details": {"reasoning_tokens": 3}}


def chunk(delta: dict, finish_reason=None, stop_reason=None, usage=None) -> dict:
    choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "stop_reason": stop_reason}]
    return {"choices": choices if delta is not None else [], "usage": usage or USAGE}


def streamed(chunks: list, warm_only: bool = False) -> list[tuple[str, dict]]:
    async def source():
        for c in chunks:
            if isinstance(c, Exception):
                raise c
            yield c

    async def collect():
        return [e async for e in event_stream(source(), "msg_1", "m", lambda exc, _: exc.body(), warm_only)]

    events = []
    for raw in asyncio.run(collect()):
        head, data = raw.decode().split("\n", 1)
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def accumulated(events: list[tuple[str, dict]]) -> Message:
    snapshot, bufs = None, {}
    for kind, data in events:
        assert data["type"] == kind
        if kind not in ("ping", "error"):
            snapshot = accumulate_event(event=EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


@pytest.mark.parametrize("finish,stop,reason,sequence", [
    ("stop", None, "end_turn", None), ("stop", 2, "end_turn", None), ("stop", "\n\n", "stop_sequence", "\n\n"),
    ("length", None, "max_tokens", None), ("tool_calls", None, "tool_use", None)])
def test_a_stream_accumulates_to_the_whole_message(finish, stop, reason, sequence):
    chunks = [chunk({"role": "assistant", "content": ""}), None, chunk({"reasoning": "Hm, "}),
              chunk({"reasoning": "cold."}), chunk({"content": "It is "}), chunk({"content": "4 C."}),
              chunk({"tool_calls": [CALL]}),
              chunk({}, finish, stop), chunk(None)]
    events = streamed(chunks)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"] and "ping" in kinds
    final = accumulated(events)
    whole = Message.model_validate(message_object({"choices": [{"message": {
        "reasoning": "Hm, cold.", "content": "It is 4 C.", "tool_calls": [CALL]}, "finish_reason": finish,
        "stop_reason": stop}], "usage": USAGE}, "msg_1", "m"))
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None), getattr(b, "input", None))
            for b in final.content] == [(b.type, getattr(b, "thinking", None), getattr(b, "text", None),
                                         getattr(b, "input", None)) for b in whole.content]
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"] and whole.content[2].id == "toolu_abc"
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence) == (reason, sequence)
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (7, 4, 7)
    assert whole.usage.output_tokens_details.thinking_tokens == 3
    assert [e["index"] for k, e in events if k == "content_block_start"] == [0, 1, 2]


def test_max_tokens_0_streams_no_block_and_counts_no_output():
    events = streamed([chunk({"content": "Hello"}), chunk({}, "length"), chunk(None)], warm_only=True)
    assert [kind for kind, _ in events] == ["message_start", "message_delta", "message_stop"]
    final = accumulated(events)
    assert (final.content, final.stop_reason, final.usage.output_tokens) == ([], "max_tokens", 0)


def test_an_error_after_the_headers_is_anthropics_error_event():
    events = streamed([chunk({"content": "It"}), OpenAIError(503, "the engine replica failed; retry")])
    assert events[-1] == ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                               "message": "the engine replica failed; retry"}})
    assert envelope(503, "x")["error"]["type"] == "service_unavailable"  # the OpenAI routes' envelope is unchanged


def test_the_readme_table_lists_every_field_the_route_takes():
    text = (Path(__file__).parents[2] / "README.md").read_text()
    table = text[text.index("<!-- messages-fields:start -->"):text.index("<!-- messages-fields:end -->")]
    listed = {name for line in table.splitlines() if line.startswith("| `")
              for name in re.findall(r"`(\w+)`", line.split(" | ")[0])}
    assert listed == set(MessagesRequest.model_fields)
