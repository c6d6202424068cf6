"""benchmarks/repetition_cost.py's hostile stream is what it claims: three tokens, no square anywhere (so a rule of
min_count 2 never fires however large its window), which the engine's runs agree with."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from repetition_cost import square_free  # noqa: E402

from engine.repetition import RepetitionDetection, RepetitionRuns  # noqa: E402


def test_the_hostile_stream_is_ternary_and_square_free():
    word = square_free(400)
    assert len(word) == 400 and set(word) == {0, 1, 2}
    squares = [(i, p) for i in range(len(word)) for p in range(1, (len(word) - i) // 2 + 1)
               if word[i:i + p] == word[i + p:i + 2 * p]]
    assert squares == []
    runs, tokens = RepetitionRuns.within(RepetitionDetection(200, 1, 2), len(word)), []
    for token in word:
        tokens.append(token)
        assert not runs.append(tokens, 0)
