"""The Responses API's translation, as pure logic: a request becomes the chat request it means, and chat chunks
become the typed event stream OpenAI's client parses (checked with the client's own models)."""
import asyncio
import json
import typing

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import ValidationError

from serve_app.errors import OpenAIError, envelope
from serve_app.responses_api import ResponsesRequest, renamed
from serve_app.responses_api_output import event_stream, response_object

# each stream event's model in OpenAI's client, by its type
EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
          for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_input_items_become_chat_messages_with_instructions_first_and_calls_grouped():
    request = ResponsesRequest.model_validate({"instructions": "Be brief.", "tools": [TOOL], "input": [
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Oslo?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "4 C"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Cold."}]},
    ], "max_output_tokens": 9, "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "tool_choice": "none"})
    chat = request.chat_request()
    roles = [(m.role, m.content if isinstance(m.content, str) else None) for m in chat.messages]
    assert roles == [("system", "Be brief."), ("system", "Use metric units."), ("user", "Weather in Oslo?"),
                     ("assistant", None), ("tool", "4 C"), ("assistant", "Cold.")]
    assert [c.id for c in chat.messages[3].tool_calls] == ["call_1", "call_2"]
    assert chat.max_completion_tokens == 9 and chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.tools[0].function.name == "get_weather" and chat.effective_tool_choice == "none"


@pytest.mark.parametrize("body,field", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"truncation": "auto"}, "truncation"), ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"background": True}, "background"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"enable_response_messages": True}, "enable_response_messages"),
    ({"previous_input_messages": [{"role": "user", "content": "hi"}]}, "previous_input_messages"),
    ({"return_prompt_text": True}, "return_prompt_text"), ({"stream_interval": 4}, "stream_interval"),
    ({"logprob_token_ids": [5]}, "logprob_token_ids"),
])
def test_stateful_and_unserved_fields_are_refused_by_name(body, field):
    with pytest.raises(ValidationError) as refused:
        ResponsesRequest.model_validate({"input": "hi", **body})
    assert refused.value.errors()[0]["ctx"]["path"] == field


def test_a_check_of_the_chat_request_names_the_responses_field():
    request = ResponsesRequest.model_validate({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function",
                                                                                              "name": "nope"}})
    with pytest.raises(OpenAIError) as refused:
        request.chat_request()
    assert refused.value.param == "tool_choice" and "nope" in refused.value.message
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})


def chat_body(content, calls=(), finish="stop"):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]
    return {"id": "r", "object": "chat.completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def test_a_whole_reply_becomes_a_response_the_client_reads():
    request = ResponsesRequest.model_validate({"input": "hi", "tools": [TOOL]})
    text = Response.model_validate(response_object(chat_body("Hello"), request, "resp_1", "m"))
    assert text.output_text == "Hello" and text.status == "completed" and text.usage.total_tokens == 10
    call = Response.model_validate(response_object(chat_body(None, [("get_weather", '{"city": "Rome"}')], "tool_calls"),
                                                   request, "resp_2", "m"))
    (item,) = call.output
    assert item.type == "function_call" and item.call_id == "call_0" and json.loads(item.arguments) == {"city": "Rome"}
    cut = Response.model_validate(response_object(chat_body("Hel", finish="length"), request, "resp_3", "m"))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def stream_of(chunks, fail=None):
    async def gen():
        for chunk in chunks:
            yield chunk
        if fail:
            raise fail

    async def collect():
        request = ResponsesRequest.model_validate({"input": "hi", "stream": True})
        out = []
        async for raw in event_stream(gen(), request, "resp_9", "m", lambda exc, _: envelope(504, "timed out", code="timeout")):
            raw = raw if isinstance(raw, str) else raw.decode()
            if raw.startswith(":"):  # a keep-alive
                continue
            kind, data = raw.strip().split("\n")
            payload = json.loads(data[len("data: "):])
            event = EVENTS[payload["type"]].model_validate(payload)
            assert kind == f"event: {event.type}"
            out.append(event)
        return out

    return asyncio.run(collect())


def delta(**fields):
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def test_chat_chunks_become_numbered_events_with_text_then_calls_and_the_whole_response_last():
    call = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events = stream_of([delta(role="assistant", content="Hi"), None, delta(content=" there"), delta(tool_calls=[call]),
                        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
                        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert final.output_text == "Hi there" and final.output[1].call_id == "call_a" and final.usage.output_tokens == 4


def test_an_error_after_the_headers_is_an_error_event_then_a_failed_response():
    events = stream_of([delta(role="assistant", content="Hi")], fail=TimeoutError())
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "timeout" and events[-1].response.status == "failed"


def test_vllms_sampling_extensions_pass_to_the_chat_request_and_chat_only_fields_are_refused():
    chat = ResponsesRequest.model_validate({"input": "hi", "top_k": 3, "seed": 7, "ignore_eos": True,
                                            "nonsense": 1}).chat_request()
    assert (chat.top_k, chat.seed, chat.ignore_eos) == (3, 7, True)
    with pytest.raises(OpenAIError) as refused:
        ResponsesRequest.model_validate({"input": "hi", "watermarking": True}).chat_request()
    assert refused.value.param == "watermarking"
    with pytest.raises(ValidationError, match="use_beam_search in a response"):
        ResponsesRequest.model_validate({"input": "hi", "use_beam_search": True})
    assert ResponsesRequest.model_validate({"input": "hi", "use_beam_search": False}).chat_request().n == 1
    for field in ("n", "messages", "max_tokens", "logprobs"):
        with pytest.raises(ValidationError) as refused:
            ResponsesRequest.model_validate({"input": "hi", field: 2})
        assert refused.value.errors()[0]["ctx"]["path"] == field


def test_a_refusal_from_the_chat_route_or_the_engine_names_the_responses_spelling():
    from serve_app.responses_api import renamed

    error = renamed(OpenAIError(400, "max_tokens is 9; this server allows at most 4", "max_tokens"))
    assert (error.param, error.message) == ("max_output_tokens", "max_output_tokens is 9; this server allows at most 4")
    error = renamed(OpenAIError(400, "messages.2.content: too long", "messages.2.content"))
    assert (error.param, error.message) == ("input", "input: too long")
    assert renamed(OpenAIError(400, "tools.0: bad", "tools.0")).param == "tools.0"


def test_prompt_logprobs_are_refused_not_dropped():
    with pytest.raises(ValidationError) as refused:
        ResponsesRequest.model_validate({"input": "hi", "prompt_logprobs": 1})
    assert refused.value.errors()[0]["ctx"]["path"] == "prompt_logprobs"


def test_sampling_fields_a_request_leaves_unset_stay_unset_for_the_models_defaults():
    from serve_app.generation_job import defaulted_fields
    from serve_app.openai_protocol import ChatCompletionRequest

    unset = ResponsesRequest.model_validate({"input": "hi"}).chat_request()
    assert defaulted_fields(unset) == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    chosen = ResponsesRequest.model_validate({"input": "hi", "temperature": 1.0}).chat_request()
    assert defaulted_fields(chosen) == {"top_p", "top_k", "min_p", "repetition_penalty"}  # 1.0 was asked for
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "top_k": 5,
                                                 "min_p": 0.0})
    assert defaulted_fields(chat) == {"temperature", "top_p", "repetition_penalty"}
    beams = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                  "use_beam_search": True})
    assert defaulted_fields(beams) == frozenset()  # a beam search samples nothing


def test_reasoning_effort_is_chats_and_a_refusal_of_it_names_the_responses_field():
    request = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "low"}})
    assert request.chat_request().reasoning_effort == "low"
    assert request.echo()["reasoning"] == {"effort": "low", "summary": None}
    assert ResponsesRequest.model_validate({"input": "hi"}).chat_request().reasoning_effort is None
    refused = renamed(OpenAIError(400, "reasoning_effort: the chat template does not read it", "reasoning_effort"))
    assert refused.param == "reasoning.effort"
    assert refused.message == "reasoning.effort: the chat template does not read it"
    with pytest.raises(ValidationError) as summary:  # no summaries of the thinking: it comes back whole
        ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}})
    assert summary.value.errors()[0]["loc"] == ("reasoning", "summary")
