"""The reasoning parsers' text splitting (serve_app/reasoning.py): a whole output and the same output streamed in
deltas cut at every place give the same reasoning and answer, as vLLM's deepseek_r1 and qwen3 parsers split them."""
import pytest

from serve_app.reasoning import PARSERS, ReasoningSplitter, split

CASES = [
    # (parser, output, reasoning, answer)
    ("deepseek_r1", "<think>Add them: 4.</think>\n\nThe sum is 4.", "Add them: 4.", "\n\nThe sum is 4."),
    ("deepseek_r1", "Add them: 4.</think>The sum is 4.", "Add them: 4.", "The sum is 4."),  # the template opened it
    ("deepseek_r1", "still thinking when max_tokens came", "still thinking when max_tokens came", None),
    ("deepseek_r1", "\n<think>x</think>", "x", None),
    ("qwen3", "<think>\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"),
    ("qwen3", "no thinking at all", None, "no thinking at all"),
    ("qwen3", "<think></think>answer", "", "answer"),
    ("qwen3", "<thinking is not the marker", None, "<thinking is not the marker"),
    ("qwen3", "<think>cut off in the middle </thi", "cut off in the middle </thi", None),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "", None, None),
    ("deepseek_r1", "a < b and </ c </think> d </think> e", "a < b and </ c ", " d </think> e"),
]


@pytest.mark.parametrize("parser, output, reasoning, answer", CASES)
def test_a_whole_output_splits_as_vllms_parsers_split_it(parser, output, reasoning, answer):
    assert split(output, PARSERS[parser]) == (reasoning, answer)


@pytest.mark.parametrize("parser, output, reasoning, answer", CASES)
def test_streamed_in_any_two_or_three_pieces_it_splits_the_same(parser, output, reasoning, answer):
    for i in range(len(output) + 1):
        for j in range(i, len(output) + 1):
            splitter = ReasoningSplitter(PARSERS[parser])
            pieces = [splitter.feed(part) for part in (output[:i], output[i:j], output[j:])] + [splitter.finish()]
            got_reasoning = "".join(r for r, _ in pieces)
            got_answer = "".join(a for _, a in pieces)
            assert (got_reasoning if splitter.reasoned else None, got_answer or None) == (reasoning, answer), (i, j)


def test_reasoning_streams_before_the_end_marker_arrives():
    splitter = ReasoningSplitter(PARSERS["qwen3"])
    assert splitter.feed("<think>step one, ") == ("step one, ", "")
    assert splitter.feed("step two </th") == ("step two ", "")  # what could begin </think> waits
    assert splitter.feed("ink>The") == ("", "The")
    assert splitter.feed(" answer") == ("", " answer")


def test_reasoning_tokens_are_counted_between_the_markers():
    from serve_app.reasoning import reasoning_token_count

    start, end = [7], [8, 9]  # a two-token end marker
    assert reasoning_token_count([7, 1, 2, 3, 8, 9, 4], PARSERS["qwen3"], start, end) == 3
    assert reasoning_token_count([1, 2, 8, 9, 4], PARSERS["qwen3"], start, end) == 0  # qwen3 did not think
    assert reasoning_token_count([1, 2, 8, 9, 4], PARSERS["deepseek_r1"], start, end) == 2  # the template opened it
    assert reasoning_token_count([7, 1, 2, 8], PARSERS["deepseek_r1"], start, end) == 3  # cut off: all thinking
    assert reasoning_token_count([], PARSERS["deepseek_r1"], start, end) == 0
