"""Incremental detokenization: the deltas add up to the full decode and never hold a broken character; the
byte-level table's chunks are DecodeStream's."""
import random

import pytest

from engine.detokenizer import (REPLACEMENT_CHAR, ByteLevelDetokenizer, BytePieces, IncrementalDetokenizer,
                                detokenizer_for)

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


def _streams(pieces, seed: int, count: int):
    """Token streams a model could emit: real texts' tokens, single bytes that split or break characters, special
    tokens, and ids past the tokenizer's vocabulary (a model's padded embedding)."""
    rng = random.Random(seed)
    singles = [i for i, piece in enumerate(pieces.raw) if len(piece) == 1]
    specials = sorted(pieces.special)
    for _ in range(count):
        stream = []
        while len(stream) < 40:
            kind = rng.randrange(5)
            if kind == 0:
                stream += [rng.randrange(len(pieces.raw))]
            elif kind == 1:
                stream += rng.sample(singles, 3)  # bytes >= 0x80 among them: partial and broken characters
            elif kind == 2:
                stream += [rng.choice(specials)]
            elif kind == 3:
                stream += [len(pieces.raw) + rng.randrange(64)]
            else:
                stream += _TEXT_IDS[rng.randrange(len(_TEXT_IDS))]
        yield stream


_TEXT_IDS: list[list[int]] = []


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("which", ["embedded", "synthetic"])
def test_the_byte_table_emits_decode_streams_chunks_token_for_token(request, which, skip_special_tokens):
    from tests.fixtures.tiny_models import synthetic_tokenizer
    tokenizer = request.getfixturevalue("tokenizer") if which == "embedded" else synthetic_tokenizer()
    pieces = BytePieces.of(tokenizer)
    assert pieces is not None and pieces.special, "both tokenizers are byte-level BPE with special tokens"
    _TEXT_IDS[:] = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    held = 0
    for stream in _streams(pieces, seed=len(which) + skip_special_tokens, count=150):
        stream_detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
        table_detok = ByteLevelDetokenizer(pieces, skip_special_tokens)
        expected = [stream_detok.add(i) for i in stream] + [stream_detok.flush()]
        assert [table_detok.add(i) for i in stream] + [table_detok.flush()] == expected, stream
        held += expected.count("")
    assert held > 150, "the streams must hold text back (partial characters, U+FFFD, skipped tokens) to test that"


def test_tokenizers_the_table_cannot_reproduce_keep_decode_stream(tokenizer):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    word_piece.decoder = decoders.WordPiece()
    assert BytePieces.of(PreTrainedTokenizerFast(tokenizer_object=word_piece)) is None
    spaced = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()))
    assert BytePieces.of(spaced) is not None
    spaced.add_tokens(["<think> "])  # a space: the byte-level decoder's text and the verbatim one differ
    assert BytePieces.of(spaced) is None
    assert isinstance(detokenizer_for(spaced, None, [1, 2]), IncrementalDetokenizer)
