"""Seeded chat workloads for the benchmarks: a synthetic mix, a copy-heavy one, and the load test's own prompts."""
from __future__ import annotations

import random
from dataclasses import dataclass

TOPICS = ["the ocean", "a lighthouse keeper", "prime numbers", "green tea", "a lost robot", "volcanoes", "jazz",
          "winter in a small town", "honeybees", "the printing press", "black holes", "a chess match", "bread baking",
          "the Roman roads", "a desert caravan", "photosynthesis"]
TASKS = ["Write a story about {t}.", "Explain {t} to a ten-year-old.", "Give me five facts about {t}.",
         "Write a poem about {t}.", "Describe {t} in detail, step by step.", "What would a scientist say about {t}?"]
CONTEXT = ("Consider the following notes carefully before you answer. They were written quickly and may repeat "
           "themselves, but every sentence matters to the reader who asked. ")


@dataclass
class Request:
    messages: list[dict[str, str]]
    max_tokens: int


def chat_workload(num_requests: int = 256, min_tokens: int = 16, max_tokens: int = 256, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        task = rng.choice(TASKS).format(t=rng.choice(TOPICS))
        content = CONTEXT * rng.randint(0, 4) + task  # prompts of about 20 to 170 tokens
        requests.append(Request([{"role": "user", "content": content}], rng.randint(min_tokens, max_tokens)))
    return requests


COPY_TASKS = ["Repeat the following text word for word:\n{p}", "Summarise the following text, quoting its key sentences:\n{p}",
              "Extract every fact from the following text as a bulleted list, in its own words:\n{p}",
              "Rewrite the following text with each sentence on its own line:\n{p}"]


def copy_workload(num_requests: int = 16, max_tokens: int = 128, seed: int = 0) -> list[Request]:
    """Copy-heavy chat requests, where an answer repeats much of its prompt (what n-gram speculation feeds on):
    repetitions, quoting summaries and extractions of the shipped evaluation paragraphs."""
    from eval_texts import PARAGRAPHS  # the sibling module

    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        paragraphs = " ".join(rng.sample(PARAGRAPHS, 2))
        content = rng.choice(COPY_TASKS).format(p=paragraphs)
        requests.append(Request([{"role": "user", "content": content}], max_tokens))
    return requests


def loadtest_workload(num_requests: int = 256, min_tokens: int = 16, max_tokens: int = 256, seed: int = 0) -> list[Request]:
    """The load test's prompt mix (loadtest/prompts.py: stories, questions, long summaries, a shared system prompt),
    so an offline figure and a served one come from the same prompts; output lengths seeded as chat_workload's."""
    from loadtest.prompts import load_prompts

    rng = random.Random(seed)
    return [Request(p.messages, rng.randint(min_tokens, max_tokens)) for p in load_prompts(num_requests, seed)]


WORKLOADS = {"chat": chat_workload, "loadtest": loadtest_workload}
