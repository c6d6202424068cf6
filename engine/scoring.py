"""Text pairs scored by their embeddings, as vLLM scores with a model that embeds: each pair's score is the cosine
similarity of the two texts' vectors. One first text is scored against each second text, or a list of first texts
pair by pair against as many second texts."""
from __future__ import annotations

import numpy as np

from engine.errors import EngineInputError


def check_pairs(firsts: int, seconds: int, names: tuple[str, str] = ("text_1", "text_2")) -> None:
    """One first text against each second, or as many of each, pair by pair; `names`: the sides' names in errors."""
    first, second = names
    if firsts == 0 or seconds == 0:
        raise EngineInputError(f"{first} and {second} each need a text", first if firsts == 0 else second)
    if firsts > 1 and firsts != seconds:
        raise EngineInputError(f"{first} has {firsts} texts and {second} {seconds}: give {first} one text, or as "
                               f"many as {second}", first)


def cosine_scores(vectors: list[bytes], firsts: int) -> list[float]:
    """Vectors (float32 little-endian bytes, as the engine gives them) of `firsts` first texts, then the second
    texts: each second text's cosine similarity with its first (the only first where there is one)."""
    matrix = np.frombuffer(b"".join(vectors), dtype="<f4").reshape(len(vectors), -1).astype(np.float64)
    matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
    first, second = matrix[:firsts], matrix[firsts:]
    return np.einsum("ij,ij->i", np.broadcast_to(first, second.shape) if firsts == 1 else first, second).tolist()
