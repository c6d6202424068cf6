"""Incremental detokenization that never emits a partial UTF-8 character, on `tokenizers`' own `DecodeStream`
(one Rust call per token, where decoding two growing windows through the transformers wrapper cost about 3x more)."""
from __future__ import annotations

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
