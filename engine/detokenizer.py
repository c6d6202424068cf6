"""Incremental detokenization that never emits a partial UTF-8 character, on `tokenizers`' own `DecodeStream`
(one Rust call per token, where decoding two growing windows through the transformers wrapper cost about 3x more)."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # tokenizers decide a token's leading space from what precedes it


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        if not tokenizer.is_fast:
            raise ValueError(f"{type(tokenizer).__name__} has no fast (Rust) tokenizer, which streaming decode needs")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(ids=list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens)
        self.pending: list[int] = []  # tokens of a character not yet complete

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty while a character is still partial)."""
        chunk = self.stream.step(self.tokenizer.backend_tokenizer, token_id)
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
