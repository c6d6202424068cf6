"""The load-test prompt mix: seeded and reproducible, with lengths spread so prefill and decode both matter.

Four kinds, in equal shares: short stories, questions, summaries of a given paragraph, and chat under a shared
system prompt (which the prefix cache should recognise).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

DEFAULT_COUNT = 2000
KINDS = ("story", "question", "summary", "chat")
SYSTEM_PROMPT = ("You are a helpful, precise assistant for a public library. Answer in plain language, keep answers "
                 "short unless asked otherwise, say when you are unsure, and never invent sources or quotations.")
SUBJECTS = ["a lighthouse keeper", "a lost robot", "two rival bakers", "a fox in the city", "an old clockmaker",
            "a girl who collects maps", "a retired astronaut", "a talking river", "a chess prodigy", "a night train",
            "a beekeeper", "a stubborn goat", "a painter who lost her colours", "a forgotten library", "a desert well"]
STORY_STYLES = ["Write a short story about {s}.", "Tell a bedtime story about {s}.", "Write a funny story about {s}.",
                "Write a sad story about {s} in five sentences.", "Write a fable about {s} with a moral at the end."]
QUESTIONS = ["Why is the sky blue?", "How do vaccines train the immune system?", "What causes the seasons?",
             "How does a refrigerator keep food cold?", "Why do cats purr?", "What is a prime number?",
             "How do airplanes stay in the air?", "What is the difference between weather and climate?",
             "How does compound interest work?", "Why does bread rise?", "What is photosynthesis?",
             "How do noise-cancelling headphones work?", "Why is the ocean salty?", "What is inflation?",
             "How are rainbows formed?", "What does a CPU cache do?", "Why do leaves change colour in autumn?"]
CHAT_ASKS = ["Can you recommend three novels for a teenager who likes science?", "How do I renew a borrowed book?",
             "What is the best way to start learning history?", "Suggest a reading plan for one month of poetry.",
             "How do I cite a website in an essay?", "What are good books about the ocean?",
             "Explain the Dewey decimal system briefly.", "How can I find old newspapers from my town?"]
NAMES = ["Ada", "Bruno", "Chen", "Dara", "Emeka", "Freya", "Gus", "Hana", "Ivo", "Jun", "Kofi", "Lena", "Mateo",
         "Nia", "Oskar", "Priya", "Quinn", "Rosa", "Sami", "Tove"]
PLACES = ["a fishing village", "Mars", "a busy market", "the Arctic", "a small island", "an old castle", "a rainforest",
          "a space station", "a mountain pass", "a city rooftop", "a desert town", "a houseboat"]
WORDS = ("the council met on a cold morning to discuss the river bridge which had been closed since spring after "
         "engineers found cracks in two of its supports local shops reported fewer customers and the school bus "
         "took a longer road the mayor promised repairs before winter but the budget was small and a vote on new "
         "taxes failed last year residents wrote letters and a group of students built a model of a new design "
         "that used less steel several experts praised it and the council agreed to study it further").split()


@dataclass
class Prompt:
    kind: str
    messages: list[dict[str, str]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def paragraph(rng: random.Random, min_words: int, max_words: int) -> str:
    start = rng.randrange(len(WORDS))
    n = rng.randint(min_words, max_words)
    words = [WORDS[(start + i) % len(WORDS)] for i in range(n)]
    return " ".join(words).capitalize() + "."


def make_prompt(kind: str, rng: random.Random) -> Prompt:
    if kind == "story":
        story = rng.choice(STORY_STYLES).format(s=rng.choice(SUBJECTS))
        return Prompt(kind, [{"role": "user", "content": f"{story} It is set in {rng.choice(PLACES)}, and the hero is "
                                                         f"called {rng.choice(NAMES)}."}])
    if kind == "question":
        lead = rng.choice(["", "Briefly: ", "Explain to a child: ", "In detail, "])
        who = f"I am {rng.choice(NAMES)}, {rng.randint(8, 80)} years old. "
        return Prompt(kind, [{"role": "user", "content": who + lead + rng.choice(QUESTIONS)}])
    if kind == "summary":
        text = paragraph(rng, 40, 320)  # the long prefills of the mix
        return Prompt(kind, [{"role": "user", "content": f"Summarise this paragraph in two sentences:\n\n{text}"}])
    ask = f"{rng.choice(CHAT_ASKS)} (Reader card {rng.randint(1000, 9999)}.)"
    return Prompt(kind, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": ask}])


def load_prompts(count: int = DEFAULT_COUNT, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    return [make_prompt(KINDS[i % len(KINDS)], rng) for i in range(count)]
