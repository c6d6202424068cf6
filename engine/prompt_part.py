"""A prompt joined from parts (vLLM's generative scoring joins a query and an item), each encoded alone. Torch-free:
the Serve ingress builds them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptPart:
    """One part of a prompt joined from several: a text, encoded alone (with the tokenizer's special tokens where
    `special_tokens`), or token ids as they are; `param` names it in errors."""

    content: str | list[int]
    param: str
    special_tokens: bool = False
