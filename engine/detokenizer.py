"""Incremental detokenization that never emits a partial UTF-8 character: on `tokenizers`' own `DecodeStream` (one
Rust call per token, where decoding two growing windows through the transformers wrapper cost about 3x more), and for
byte-level BPE tokenizers (Qwen2, Llama 3, SmolLM2) from a table of every token's bytes, which emits the same chunks
for a list index a token where the Rust call cost ~5 us in a running engine (caches cold after the forward)."""
from __future__ import annotations

import codecs
from dataclasses import dataclass

from tokenizers.decoders import ByteLevel, DecodeStream
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # tokenizers decide a token's leading space from what precedes it


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        if not tokenizer.is_fast:
            raise ValueError(f"{type(tokenizer).__name__} has no fast (Rust) tokenizer, which streaming decode needs")
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer  # a property of the wrapper: read once, not a token at a time
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(ids=list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens)
        self.pending: list[int] = []  # tokens of a character not yet complete

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty while a character is still partial)."""
        chunk = self.stream.step(self.backend, token_id)
        if chunk is None:
            self.pending.append(token_id)
            return ""
        self.pending.clear()
        return chunk

    def flush(self) -> str:
        """Whatever remains at the end, partial characters included."""
        text = self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special_tokens) if self.pending else ""
        self.pending.clear()
        return text


@dataclass(frozen=True)
class BytePieces:
    """Every token's bytes, for a tokenizer whose decoder is byte-level alone: its text is the UTF-8 decoding
    (lossy) of its tokens' bytes joined, whatever precedes them, so a table and an incremental UTF-8 decoder give it.
    Added tokens are taken only where their text maps to itself byte for byte, where the decoder's path and the
    verbatim text agree; a tokenizer with any other has no table (None from `of`) and keeps DecodeStream."""
    raw: list[bytes]  # by token id; b"" for ids the tokenizer does not know (it decodes them to nothing)
    texts: list[str | None]  # the token's text where its bytes are whole characters on their own
    special: frozenset[int]

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> "BytePieces | None":
        backend = tokenizer.backend_tokenizer if tokenizer.is_fast else None
        if backend is None or type(backend.decoder) is not ByteLevel:
            return None
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        added = backend.get_added_tokens_decoder()
        pieces = {i: piece for piece, i in backend.get_vocab(with_added_tokens=False).items() if i not in added}
        if not set("".join(pieces.values())) <= byte_of.keys():
            return None
        if not all(byte_of.get(char) == ord(char) for token in added.values() for char in token.content):
            return None
        raw = [b""] * (max([*pieces, *added], default=-1) + 1)
        to_latin1 = str.maketrans({char: chr(byte) for char, byte in byte_of.items()})
        for i, piece in pieces.items():
            raw[i] = piece.translate(to_latin1).encode("latin-1")
        for i, token in added.items():
            raw[i] = token.content.encode()
        return cls(raw, [_whole(piece) for piece in raw], frozenset(i for i, t in added.items() if t.special))


def _whole(piece: bytes) -> str | None:
    try:
        return piece.decode()
    except UnicodeDecodeError:
        return None


class ByteLevelDetokenizer:
    """IncrementalDetokenizer's chunks from a BytePieces table. As DecodeStream, a token's text is held back while it
    ends inside a character or with U+FFFD, and comes out with the next token's."""

    def __init__(self, pieces: BytePieces, skip_special_tokens: bool = True):
        self.pieces = pieces
        self.skipped = pieces.special if skip_special_tokens else frozenset()
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.mid_char = False  # the decoder holds the first bytes of a character
        self.held = ""

    def add(self, token_id: int) -> str:
        pieces = self.pieces
        if token_id in self.skipped or not 0 <= token_id < len(pieces.raw):
            return ""
        text = None if self.mid_char else pieces.texts[token_id]
        if text is None:
            text = self.utf8.decode(pieces.raw[token_id])
            self.mid_char = bool(self.utf8.getstate()[0])
        if self.held:
            text, self.held = self.held + text, ""
        if self.mid_char or text.endswith(REPLACEMENT_CHAR):
            self.held = text
            return ""
        return text

    def flush(self) -> str:
        text, self.held = self.held + self.utf8.decode(b"", final=True), ""
        self.mid_char = False
        return text


def detokenizer_for(tokenizer: PreTrainedTokenizerBase, pieces: BytePieces | None, prompt_token_ids: list[int],
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer | ByteLevelDetokenizer:
    """The table's detokenizer where the tokenizer has one (BytePieces.of), else DecodeStream's. A prompt that ends
    inside a character is the one difference: the table starts the completion's bytes afresh."""
    if pieces is not None:
        return ByteLevelDetokenizer(pieces, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)


class TokenTexts:
    """Each token's own text and raw bytes, as OpenAI's logprobs report them. Byte-level BPE pieces map back to
    their exact bytes (a piece may hold part of a character); other tokenizers decode the token alone."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer  # a private instance: fast tokenizers are not shareable across threads
        self.byte_level = isinstance(tokenizer.backend_tokenizer.decoder, ByteLevel)
        self.byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self.cache.get(token_id)
        if found is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if self.byte_level and all(char in self.byte_of for char in piece):
                raw = bytes(self.byte_of[char] for char in piece)
            else:
                raw = self.tokenizer.decode([token_id]).encode("utf-8")
            found = self.cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found
