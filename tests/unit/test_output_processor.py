"""The front end's output half on a real (synthetic, offline) tokenizer: the core's token ids become text, stop strings
end requests here and name them for the core to stop, and nothing the core sends after the end reaches a reader."""
import pytest

from engine.core_messages import CoreOutput, EngineRequest
from engine.errors import EngineInputError
from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from engine.sequence import RequestMetrics
from tests.fixtures.tiny_models import synthetic_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic_tokenizer()


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def start(tokenizer, request_id: str = "r", final_only: bool = False, **params) -> OutputProcessor:
    processor = OutputProcessor(tokenizer, [EOS])
    processor.add(EngineRequest(request_id, ids_of(tokenizer, "Say:"), SamplingParams(**params), 64, 0.0), final_only)
    return processor


def core(tokens: list[int], finish: str | None = None, request_id: str = "r", error: str | None = None,
         logprobs: list[dict[int, float]] | None = None) -> CoreOutput:
    return CoreOutput(request_id, tokens, RequestMetrics(0.0), finish, error, logprobs)


def test_one_token_at_a_time_the_deltas_add_up_to_the_text_and_hold_no_broken_character(tokenizer):
    text = "Hello world 🐉 done"
    processor = start(tokenizer)
    tokens = ids_of(tokenizer, text)
    outputs = [processor.process([core([token])])[0][0] for token in tokens[:-1]]
    (last,), stopped = processor.process([core(tokens[-1:], "length")])
    outputs.append(last)
    assert "".join(o.delta_text for o in outputs) == text == last.text and not stopped
    assert not any("\ufffd" in o.delta_text for o in outputs)
    assert last.token_ids == tokens and last.finished and "r" not in processor.requests


@pytest.mark.parametrize("reason", ["length", "repetition"])
def test_an_output_the_core_ends_inside_a_character_keeps_its_partial_bytes(tokenizer, reason):
    """The core may end an output (its length, a repeated pattern) one token into a character: the text ends as the
    tokenizer decodes those tokens, not short of them."""
    tokens = ids_of(tokenizer, "ok 🐉")[:-1]
    assert tokenizer.decode(tokens).endswith("\ufffd"), "the cut must fall inside the character"
    (out,), stopped = start(tokenizer).process([core(tokens, reason)])
    assert out.text == tokenizer.decode(tokens) and out.finish_reason == reason and not stopped


def test_each_output_keeps_the_tokens_it_was_made_with_while_later_ones_grow(tokenizer):
    """Outputs share the request's growing token list instead of copying it (O(length) a step a stream): each must
    still read as of its own making, however many outputs come after it."""
    processor = start(tokenizer)
    tokens = ids_of(tokenizer, "one two three four five")
    outputs = [processor.process([core([token])])[0][0] for token in tokens]
    for made, out in enumerate(outputs, start=1):
        assert out.num_tokens == made and out.token_ids == tokens[:made] and out.delta_token_ids == [tokens[made - 1]]
        assert out.token_ids_since(max(0, made - 2)) == tokens[max(0, made - 2) : made]
    outputs[0].token_ids.append(0)  # a reader's copy: the others do not see it
    assert outputs[-1].token_ids == tokens


def test_a_stop_string_ends_the_request_here_cut_before_it_and_names_it_for_the_core(tokenizer):
    processor = start(tokenizer, stop=["STOP"])
    tokens = ids_of(tokenizer, "Hello world. STOP here and more")
    # one output with several tokens, as accepted drafts give: those after the stop string are not the reader's
    (out,), stopped = processor.process([core(tokens)])
    assert out.finish_reason == "stop" and out.text == "Hello world. " and stopped == {"r": "stop"}
    assert len(out.token_ids) < len(tokens) and tokenizer.decode(out.token_ids).startswith("Hello world. S")
    # the core's later outputs for it, up to its own end, reach nobody
    assert processor.process([core(ids_of(tokenizer, " x")), core([], "stop")]) == ([], {})


def test_include_stop_str_in_output_cuts_after_the_earliest_stop_string_instead(tokenizer):
    processor = start(tokenizer, stop=["world", "STOP", "wor"], include_stop_str_in_output=True)
    (out,), stopped = processor.process([core(ids_of(tokenizer, "Hello world. STOP and then"))])
    assert out.finish_reason == "stop" and out.text == "Hello wor" and stopped == {"r": "stop"}  # earliest, shortest


def test_text_that_could_still_become_a_stop_string_is_held_back_then_released(tokenizer):
    processor = start(tokenizer, stop=["STOP"])
    (first,), _ = processor.process([core(ids_of(tokenizer, "Hello ST"))])
    assert first.delta_text == "Hello"  # " ST" could start "STOP": 3 characters held
    (second,), stopped = processor.process([core(ids_of(tokenizer, "AY"))])
    assert second.delta_text == " S" and not stopped  # "TAY" could not, but 3 characters are always held
    (last,), _ = processor.process([core([], "length")])
    assert first.delta_text + second.delta_text + last.delta_text == "Hello STAY" == last.text


def test_a_stop_string_before_min_tokens_does_not_end_the_request(tokenizer):
    tokens = ids_of(tokenizer, "STOP and then STOP")
    processor = start(tokenizer, stop=["STOP"], min_tokens=len(ids_of(tokenizer, "STOP")) + 1)
    (out,), stopped = processor.process([core(tokens)])
    assert out.finish_reason == "stop" and out.text == "STOP and then " and stopped == {"r": "stop"}


def test_eos_ends_the_text_as_it_is_and_length_flushes_a_partial_character(tokenizer):
    dragon = ids_of(tokenizer, "🐉")
    processor = start(tokenizer)
    (out,), _ = processor.process([core([*ids_of(tokenizer, "hi "), dragon[0], EOS], "stop")])
    assert out.text == "hi " and out.finish_reason == "stop"
    processor = start(tokenizer)
    (out,), _ = processor.process([core([*ids_of(tokenizer, "hi "), dragon[0]], "length")])
    assert out.text.startswith("hi ") and len(out.text) > 3  # the partial bytes, as a replacement character


@pytest.mark.parametrize("params,tokens,reason,stop_token,stop_reason", [
    (dict(stop=["world", "STOP", "wor"]), "Hello world. STOP", "stop", None, "wor"),  # the one that cut the text
    (dict(stop=["STOP"], include_stop_str_in_output=True), "Hello STOP here", "stop", None, "STOP"),
    (dict(stop_token_ids=[7]), [5, 7], "stop", 7, 7),  # the core's stop check names the token
    (dict(stop_token_ids=[EOS]), [5, EOS], "stop", None, None),  # the core's: an EOS the request honours
    (dict(), [5, 6], "length", None, None),
    (dict(), [5, 6], "repetition", None, "repetition_detected"),
    (dict(stop=["STOP"]), "no stop here", None, None, None),
])
def test_the_output_names_what_stopped_it_as_vllms_stop_reason(tokenizer, params, tokens, reason, stop_token,
                                                                stop_reason):
    ids = ids_of(tokenizer, tokens) if isinstance(tokens, str) else tokens
    finish = None if isinstance(tokens, str) else reason
    out = CoreOutput("r", ids, RequestMetrics(0.0), finish, stop_token_id=stop_token)
    (out,), _ = start(tokenizer, **params).process([out])
    assert (out.finish_reason, out.stop_reason) == (reason, stop_reason)


def test_an_id_in_flight_is_refused_until_forgotten_and_a_core_error_reaches_the_reader(tokenizer):
    processor = start(tokenizer)
    request = EngineRequest("r", [1, 2], SamplingParams(), 8, 0.0)
    with pytest.raises(EngineInputError, match="already in flight"):
        processor.add(request)
    processor.forget("r")
    processor.add(request)
    (out,), stopped = processor.process([core([], "abort", error="engine step failed: RuntimeError")])
    assert out.error == "engine step failed: RuntimeError" and out.finish_reason == "abort" and not stopped
    assert processor.requests == {}


def test_a_request_whose_text_fails_ends_alone_and_the_core_is_told_to_abort_it(tokenizer, monkeypatch):
    processor = start(tokenizer, "bad")
    processor.add(EngineRequest("good", [1, 2], SamplingParams(), 8, 0.0))
    monkeypatch.setattr(processor.requests["bad"].detokenizer, "add", lambda token: 1 / 0)
    tokens = ids_of(tokenizer, "fine")
    (bad, good), ended = processor.process([core(tokens, request_id="bad"), core(tokens, request_id="good")])
    assert (bad.finish_reason, bad.error) == ("abort", "post-processing failed: ZeroDivisionError")
    assert ended == {"bad": "abort"}  # an error, not a stop string: the core ends it as one
    assert good.error is None and good.text == "fine" and good.finish_reason is None
    assert processor.process([core(tokens, request_id="bad")]) == ([], {})


def test_a_final_only_request_is_reported_once_finished_with_the_same_text_and_tokens_as_a_stream(tokenizer):
    tokens = ids_of(tokenizer, "Hello world 🐉 and a STOP here")
    streamed = start(tokenizer, "s", stop=["STOP"], logprobs=0)
    whole = start(tokenizer, "w", final_only=True, stop=["STOP"], logprobs=0)
    streams, finals = [], []
    for token in tokens:
        outputs, ended = streamed.process([core([token], request_id="s", logprobs=[{token: -1.0}])])
        streams += outputs
        outputs, ended_whole = whole.process([core([token], request_id="w", logprobs=[{token: -1.0}])])
        finals += outputs
        assert ended_whole == {"w": "stop"} if ended else not ended_whole
        if ended:
            break
    assert len(streams) > 1 and len(finals) == 1 and finals[0].finish_reason == "stop"
    last = streams[-1]
    assert (finals[0].text, finals[0].token_ids, finals[0].logprobs) == (last.text, last.token_ids, last.logprobs)
    assert finals[0].delta_text == finals[0].text == "Hello world 🐉 and a " and whole.requests == {}


def test_a_held_request_gets_no_output_before_the_count_its_reader_waits_for_and_its_deltas_still_add_up(tokenizer):
    processor = start(tokenizer)
    tokens = ids_of(tokenizer, "one two three four five six seven eight")
    assert len(tokens) >= 6
    outputs = processor.process([core(tokens[:1])])[0]
    processor.hold("r", 4)
    processor.hold("r", 2)  # a late, lower hold (a stale reader's) never brings an output earlier
    for token in tokens[1:5]:
        outputs += processor.process([core([token])])[0]
    assert [len(o.token_ids) for o in outputs] == [1, 4, 5]  # held until 4; no new hold after it: every step
    outputs += processor.process([core(tokens[5:], "length")])[0]  # the end comes whatever the hold
    processor.hold("r", 100)  # ended: nothing to hold
    assert "".join(o.delta_text for o in outputs) == outputs[-1].text == tokenizer.decode(tokens)
