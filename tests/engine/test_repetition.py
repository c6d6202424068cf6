"""vLLM's repetition detection: the runs a request keeps give the definition's answer after every token, and an
engine ends an output at the first token where a pattern has repeated enough (from min_tokens on), finish reason
"repetition", whether its tokens came one a step or several in accepted drafts."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, EngineInputError, SamplingParams
from engine.config import SpeculativeConfig
from engine.repetition import MAX_PATTERN_SIZE, RepetitionDetection, RepetitionRuns
from tests.fixtures.repetition import first_stop, repeats_at_end

PROMPTS = ["1, 2, 1, 2, 1,", "The cat sat on the mat. The cat sat on the", "List: a, b, c, d,",
           "Count: one two three", "Say yes: yes yes yes"]
FREE = dict(max_tokens=48, temperature=0.0, ignore_eos=True)
RULES = [RepetitionDetection(8, 1, 3), RepetitionDetection(8, 4, 2), RepetitionDetection(6, 6, 2),
         RepetitionDetection(16, 7, 2)]


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 2), max_size=12), output=st.lists(st.integers(0, 2), min_size=1, max_size=80),
       largest=st.integers(1, 12), smallest=st.integers(1, 12), count=st.integers(2, 5))
def test_the_runs_give_the_definitions_answer_after_every_token(prompt, output, largest, smallest, count):
    rule = RepetitionDetection(largest, min(smallest, largest), count)
    runs, tokens = RepetitionRuns.within(rule, len(output)), list(prompt)  # the output at its max_tokens
    for n, token in enumerate(output, 1):
        tokens.append(token)
        found = runs is not None and runs.append(tokens, len(prompt))
        assert found == repeats_at_end(output[:n], rule), (output[:n], rule)


def test_a_pattern_that_cannot_come_min_count_times_within_max_tokens_is_never_looked_for():
    assert RepetitionRuns.within(RepetitionDetection(MAX_PATTERN_SIZE, 3, 1 << 31), 4096) is None
    assert RepetitionRuns.within(RepetitionDetection(MAX_PATTERN_SIZE, 1, 4), 400).longest == 100


def test_the_prompt_never_counts_toward_a_pattern():
    runs, tokens = RepetitionRuns.within(RepetitionDetection(1, 1, 3), 3), [5, 5, 5, 5]
    found = []
    for _ in range(3):
        tokens.append(5)
        found.append(runs.append(tokens, 4))
    assert found == [False, False, True]


@pytest.mark.parametrize("fields,param", [
    (dict(max_pattern_size=0), "repetition_detection.max_pattern_size"),
    (dict(max_pattern_size=MAX_PATTERN_SIZE + 1), "repetition_detection.max_pattern_size"),
    (dict(max_pattern_size=4, min_pattern_size=5), "repetition_detection.min_pattern_size"),
    (dict(max_pattern_size=4, min_pattern_size=0), "repetition_detection.min_pattern_size"),
    (dict(max_pattern_size=4, min_count=1), "repetition_detection.min_count"),
    (dict(max_pattern_size=4, min_count=1 << 40), "repetition_detection.min_count"),
    (dict(max_pattern_size=4.0), "repetition_detection.max_pattern_size"),
    (dict(max_pattern_size=4, min_count=True), "repetition_detection.min_count"),
])
def test_a_rule_that_cannot_detect_anything_names_its_field(fields, param):
    with pytest.raises(EngineInputError) as refused:
        RepetitionDetection(**fields)
    assert refused.value.param == param


@pytest.fixture(scope="module")
def free(llm32):
    """Each prompt's greedy output without the rule: 48 tokens, none ended by EOS."""
    outs = llm32.generate(PROMPTS, SamplingParams(**FREE), use_tqdm=False)
    return [out.live_token_ids[: out.num_tokens] for out in outs]


def expected(free: list[list[int]], rule: RepetitionDetection, min_tokens: int) -> list[tuple[list[int], str]]:
    """Each free output cut where the rule ends it, with the reason it ends for."""
    cuts = [first_stop(output, rule, min_tokens) for output in free]
    return [(output[:cut], "repetition") if cut else (output, "length") for output, cut in zip(free, cuts)]


@pytest.mark.parametrize("min_tokens", [0, 25])
@pytest.mark.parametrize("rule", RULES, ids=str)
def test_an_output_ends_at_the_first_token_that_completes_a_repeated_pattern(llm32, free, rule, min_tokens):
    outs = llm32.generate(PROMPTS, SamplingParams(**FREE, min_tokens=min_tokens, repetition_detection=rule),
                          use_tqdm=False)
    got = [(out.live_token_ids[: out.num_tokens], out.finish_reason) for out in outs]
    assert got == expected(free, rule, min_tokens)
    assert sum(reason == "repetition" for _, reason in got) >= 1, "no prompt repeated under this rule"
    decode = llm32.inputs.tokenizer.decode
    assert all(out.text == decode(tokens, skip_special_tokens=True) for out, (tokens, _) in zip(outs, got))
    manager = llm32.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_a_pattern_completed_inside_accepted_drafts_ends_the_output_at_the_same_token(free):
    """N-gram drafts copy a repeating output ahead, so several tokens land in one step: the output still ends at the
    token that completed the pattern."""
    llm = LLM(dtype="float32", num_kv_blocks=256,
              speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, weigh_cost=False))
    outs = llm.generate(PROMPTS, SamplingParams(**FREE, repetition_detection=RULES[0]), use_tqdm=False)
    assert [(out.live_token_ids[: out.num_tokens], out.finish_reason) for out in outs] == expected(free, RULES[0], 0)
    assert llm.engine.stats().spec_accepted_tokens > 0, "no draft was accepted"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_with_steps_launched_ahead_the_output_ends_at_the_same_token(llm32, free):
    """Async scheduling launches a row's next step before its token is read: a row the token ends drops that step."""
    engine = llm32.engine
    was, ahead = engine.async_scheduling, engine.counters["num_steps_ahead"]
    engine.async_scheduling = True
    try:
        outs = llm32.generate(PROMPTS, SamplingParams(**FREE, repetition_detection=RULES[0]), use_tqdm=False)
    finally:
        engine.async_scheduling = was
    assert [(out.live_token_ids[: out.num_tokens], out.finish_reason) for out in outs] == expected(free, RULES[0], 0)
    assert engine.counters["num_steps_ahead"] > ahead, "no step was launched ahead"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
