"""Incremental detokenization: the deltas add up to the full decode and never hold a broken character."""
import pytest

from engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXTS = [
    "plain ascii text, with punctuation!",
    "naïve café déjà vu",
    "日本語のテキストと中文",
    "emoji 🐉🏰 and 👩‍👩‍👧 family",
    "  leading spaces and\nnew lines\ttabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("Say:", add_special_tokens=False))
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_a_partial_character_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("🐉", add_special_tokens=False)
    assert len(ids) > 1, "the dragon emoji must span several byte-level tokens for this test"
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🐉"
