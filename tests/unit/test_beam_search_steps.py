"""Beam search's bookkeeping (engine/beam_search.py) on hand-made log-probabilities: which beams live, which
complete, how they rank, and that ending the search early never changes its answer."""
import itertools
import math
import random

import pytest

from engine.beam_search import BeamSearch, BeamSearchParams
from engine.errors import EngineInputError

EOS = 0
PROMPT = [5, 6, 7]


def search(width: int, max_tokens: int, **kwargs) -> BeamSearch:
    return BeamSearch(PROMPT, BeamSearchParams(width, max_tokens, **kwargs), frozenset({EOS}))


def outputs(beams) -> list[list[int]]:
    return [beam.output_token_ids(len(PROMPT)) for beam in beams]


def test_the_best_continuations_over_all_beams_live_on():
    s = search(2, 4)
    s.advance([{1: math.log(0.6), 2: math.log(0.3), 3: math.log(0.1)}])
    assert outputs(s.live) == [[1], [2]]
    # beam [1] continues weakly, beam [2] strongly: both survivors come from [2]'s answers and one from [1]'s
    s.advance([{4: math.log(0.2), 5: math.log(0.1)}, {4: math.log(0.9), 5: math.log(0.05)}])
    assert outputs(s.live) == [[2, 4], [1, 4]]
    assert s.live[0].cum_logprob == pytest.approx(math.log(0.3 * 0.9))


def test_a_beam_that_draws_eos_completes_and_ranks_by_its_length_penalised_score():
    s = search(2, 3, length_penalty=1.0)
    s.advance([{EOS: math.log(0.5), 1: math.log(0.3), 2: math.log(0.2)}])
    assert outputs(s.completed) == [[]] and s.completed[0].finish_reason == "stop"
    assert outputs(s.live) == [[1], [2]]  # EOS does not take a live beam's place
    s.advance([{1: math.log(0.9), 2: math.log(0.1)}, {1: math.log(0.5), 2: math.log(0.5)}])
    s.advance([{1: math.log(0.9)}, {1: math.log(0.9)}])
    best = s.best()
    # the prompt counts in the length (vLLM's get_beam_search_score): [1,1,1] scores log(.3*.9*.9)/6 = -0.317,
    # the empty completion log(.5)/3 = -0.231
    assert outputs(best) == [[], [1, 1, 1]]
    assert [b.finish_reason for b in best] == ["stop", "length"]
    assert s._score(best[1]) == pytest.approx(math.log(0.3 * 0.9 * 0.9) / 6)


def test_length_penalty_zero_ranks_by_cumulative_logprob_alone():
    s = search(2, 2, length_penalty=0.0)
    s.advance([{EOS: math.log(0.4), 1: math.log(0.6)}])
    s.advance([{1: math.log(0.5), 2: math.log(0.5)}])
    assert outputs(s.best()) == [[], [1, 1]]  # 0.4 beats 0.3


def test_ignore_eos_treats_eos_as_a_token_and_nothing_completes():
    s = search(2, 2, ignore_eos=True)
    s.advance([{EOS: math.log(0.7), 1: math.log(0.3)}])
    assert not s.completed and outputs(s.live) == [[EOS], [1]]


def test_include_stop_str_in_output_keeps_the_eos_id_but_not_in_the_length_or_text():
    s = search(1, 2, include_stop_str_in_output=True)
    s.advance([{EOS: math.log(0.9), 1: math.log(0.1)}])
    assert outputs(s.completed) == [[EOS]]
    assert s._score(s.completed[0]) == pytest.approx(math.log(0.9) / len(PROMPT))
    result = s.result(lambda ids: ",".join(map(str, ids)))
    assert result.sequences[0].text == ""


def test_the_search_ends_at_max_tokens_or_when_no_beam_is_left():
    s = search(1, 2)
    assert not s.done
    s.advance([{1: -0.1}])
    s.advance([{1: -0.1}])
    assert s.done and s.steps == 2
    s = search(1, 5)
    s.advance([{EOS: -0.1}])  # every answer was EOS: nothing lives
    assert s.done and not s.live


def exhaustive(logprobs, width: int, max_tokens: int, length_penalty: float) -> list[list[int]]:
    """The same search without its early end."""
    s = search(width, max_tokens, length_penalty=length_penalty)
    s._no_live_beam_can_rank = lambda: False
    return run(s, logprobs)


def run(s: BeamSearch, logprobs) -> list[list[int]]:
    while not s.done:
        s.advance([logprobs(tuple(beam.tokens)) for beam in s.live])
    return outputs(s.best())


@pytest.mark.parametrize("length_penalty", [-1.0, 0.0, 0.5, 1.0, 2.0])
def test_ending_early_never_changes_the_answer(length_penalty):
    """Random trees of 4 tokens (EOS likely) searched to 6 tokens, with and without the early end: the same beams."""
    ended_early = 0
    for seed in range(60):
        rng = random.Random(seed)
        memo = {}

        def logprobs(prefix):
            if prefix not in memo:
                weights = [rng.random() ** 2 for _ in range(4)]
                weights[EOS] *= 3
                total = sum(weights)
                memo[prefix] = {t: math.log(w / total) for t, w in enumerate(weights)}
            return memo[prefix]

        full = exhaustive(logprobs, 2, 6, length_penalty)
        s = search(2, 6, length_penalty=length_penalty)
        assert run(s, logprobs) == full, seed
        ended_early += s.steps < 6
    if length_penalty <= 0:
        assert ended_early > 10  # the early end is not only possible on paper


def test_parameters_are_checked():
    with pytest.raises(EngineInputError) as bad:
        BeamSearchParams(0, 4)
    assert bad.value.param == "n"
    with pytest.raises(EngineInputError) as bad:
        BeamSearchParams(11, 4)
    assert bad.value.param == "n"
    with pytest.raises(EngineInputError) as bad:
        BeamSearchParams(2, 4, length_penalty=math.inf)
    assert bad.value.param == "length_penalty"
    with pytest.raises(EngineInputError) as bad:
        BeamSearchParams(2, 0)
    assert bad.value.param == "max_tokens"
    step = BeamSearchParams(3, 4).step_params()
    assert (step.max_tokens, step.temperature, step.logprobs) == (1, 0.0, 6)


def test_ties_keep_a_deterministic_order():
    s = search(3, 1)
    s.advance([{t: math.log(0.25) for t in itertools.islice(range(1, 9), 4)}])
    assert outputs(s.live) == [[1], [2], [3]]
