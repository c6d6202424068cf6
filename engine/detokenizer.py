"""Incremental detokenization that never emits a partial UTF-8 character."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # tokenizers decide a token's leading space from what precedes it


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty while a character is still partial)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever remains at the end, partial characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        seen = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(seen) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(seen) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False)
