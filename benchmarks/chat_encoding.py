"""What encoding a chat's control tokens as text costs (engine_config.sanitize_control_tokens, on by default)
against vLLM's encoding, per request at admission: a short conversation and a 20k-character message, medians of
5 runs, on the embedded model's tokenizer.

python benchmarks/chat_encoding.py
"""
from __future__ import annotations

import statistics
import timeit

from engine import EngineConfig
from engine.chat import encode, normalize
from engine.models import load_tokenizer

SHORT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Oslo?"},
         {"role": "assistant", "content": "It is 4 C."}, {"role": "user", "content": "And tomorrow?"}]
LONG = [{"role": "user", "content": "The sea is salty and the moon pulls it. " * 500}]


def main() -> None:
    tokenizer = load_tokenizer(EngineConfig())
    for name, messages, number in (("short conversation", SHORT, 2000), ("20k-character message", LONG, 50)):
        messages = normalize(messages)
        us = [statistics.median(timeit.timeit(lambda: encode(tokenizer, messages, sanitize=sanitize), number=number)
                                / number * 1e6 for _ in range(5)) for sanitize in (False, True)]
        print(f"{name}: vLLM's encoding {us[0]:.0f} us, control tokens as text {us[1]:.0f} us ({us[1] / us[0]:.2f}x)")


if __name__ == "__main__":
    main()
