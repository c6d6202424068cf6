"""Chat messages through the embedded model's template: text parts, tool turns, tools in the system prompt, and
the template options vLLM's clients send."""
import json

import pytest

from engine import EngineConfig, EngineInputError, SamplingParams
from engine.chat import ChatOptions, normalize, render
from engine.models import load_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EngineConfig())


def test_text_parts_render_as_their_joined_text(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(tokenizer, normalize(parts)) == render(tokenizer, [{"role": "user", "content": "a\nb"}])


def test_other_part_types_are_refused_by_position():
    with pytest.raises(EngineInputError, match=r"messages\[0\]\.content\[1\]: only text parts.*image_url"):
        normalize([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}])


def test_tools_go_into_the_system_prompt_and_tool_turns_are_written_out(tokenizer):
    messages = normalize([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}])
    text = render(tokenizer, messages, [WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call one or more functions")
    assert json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0]) == WEATHER
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\ncold\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama3_json_tools_are_described_and_written_back_in_that_format(tokenizer):
    messages = normalize([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}])
    text = render(tokenizer, messages, [WEATHER], ChatOptions(tool_format="llama3_json"))
    assert text.startswith("<|im_start|>system\nGiven the following functions") and "<tool_call>" not in text
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Oslo"}}<|im_end|>' in text
    with pytest.raises(EngineInputError, match="tool_format"):
        ChatOptions(tool_format="mistral")


def test_the_developer_role_renders_as_system(tokenizer):
    assert render(tokenizer, normalize([{"role": "developer", "content": "x"}])).startswith("<|im_start|>system\nx")


def test_a_continued_final_message_is_left_open_and_a_closed_prompt_opens_no_turn(tokenizer):
    messages = normalize([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, the answer"}])
    opened = render(tokenizer, messages[:1])
    closed = render(tokenizer, messages[:1], options=ChatOptions(add_generation_prompt=False))
    continued = render(tokenizer, messages, options=ChatOptions(add_generation_prompt=False, continue_final_message=True))
    assert opened.startswith(closed) and opened != closed and "assistant" in opened[len(closed):]
    assert continued.endswith("Well, the answer") and continued.startswith(opened)


@pytest.mark.parametrize("options", [dict(continue_final_message=True), dict(template_kwargs={"tools": []}),
                                     dict(template_kwargs={"bos_token": ""}), dict(template_kwargs={"a-b": 1}),
                                     dict(template_kwargs={f"k{i}": i for i in range(33)})])
def test_options_that_would_override_the_renderer_are_refused(options):
    with pytest.raises(EngineInputError):
        ChatOptions(**options)


def test_the_offline_chat_takes_tools_and_template_options_as_vllms_does(llm32, tokenizer):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}, {"role": "assistant", "content": "In Oslo it is"}]
    params = {"max_tokens": 4, "temperature": 0.0}

    (continued,) = llm32.chat(messages, SamplingParams(**params), use_tqdm=False, tools=[WEATHER],
                              add_generation_prompt=False, continue_final_message=True)
    text = render(tokenizer, normalize(messages), [WEATHER], ChatOptions(False, True))
    assert continued.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("In Oslo it is") and "get_weather" in text
    (plain,) = llm32.chat(messages[:1], SamplingParams(**params), use_tqdm=False)
    assert plain.prompt_token_ids == tokenizer.encode(render(tokenizer, normalize(messages[:1])), add_special_tokens=False)
    with pytest.raises(EngineInputError) as refused:
        llm32.chat(messages, SamplingParams(**params), use_tqdm=False, continue_final_message=True)
    assert refused.value.param == "continue_final_message"
