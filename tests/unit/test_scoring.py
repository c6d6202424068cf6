"""engine/scoring.py: which text pairs are scored, and their cosine similarity from the engine's float32 bytes."""
import numpy as np
import pytest

from engine import EngineInputError
from engine.scoring import check_pairs, cosine_scores


def as_bytes(rows) -> list[bytes]:
    return [np.asarray(row, dtype="<f4").tobytes() for row in rows]


def test_one_first_text_is_scored_against_each_second_and_lists_pair_by_pair():
    first, seconds = [3.0, 4.0], [[3.0, 4.0], [-3.0, -4.0], [4.0, -3.0], [6.0, 8.0]]
    assert cosine_scores(as_bytes([first, *seconds]), 1) == pytest.approx([1.0, -1.0, 0.0, 1.0])
    pairs = cosine_scores(as_bytes([[1, 0], [0, 1], [1, 1], [0, 2]]), 2)
    assert pairs == pytest.approx([2 ** -0.5, 1.0])  # (1,0)·(1,1) and (0,1)·(0,2), each at unit length


@pytest.mark.parametrize("firsts,seconds,param", [(2, 3, "text_1"), (0, 2, "text_1"), (1, 0, "text_2")])
def test_pairs_that_do_not_match_are_refused_naming_the_field(firsts, seconds, param):
    with pytest.raises(EngineInputError) as refused:
        check_pairs(firsts, seconds)
    assert refused.value.param == param


def test_matching_pairs_pass():
    for firsts, seconds in [(1, 1), (1, 5), (4, 4)]:
        check_pairs(firsts, seconds)
